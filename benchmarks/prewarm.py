"""Compile a benchmark's configurations in parallel, untimed, before it times them.

A device call is short, and most of a benchmark's first record is compilation: our CuTe
kernels, inductor's and FA4's kernels for the peers. Those land in disk caches
(jcompilemask's ``$JCOMPILEMASK_CACHE_DIR``, inductor's, FA4's with
``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``), so running each configuration once in a
worker process first — all of them at once, several per GPU, nothing timed while they run
— lets the timed pass that follows load instead of compile. ``bench_total.py`` and
``bench_head_dims.py`` use it through ``--prewarm P``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time


def without(argv, valued=(), switches=()):
    """argv less each ``--flag value`` / ``--flag=value`` of ``valued`` and each ``--flag``
    of ``switches``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in valued:
            skip = True
        elif a not in switches and not any(a.startswith(f + "=") for f in valued):
            out.append(a)
    return out


def run(script, base, jobs, workers, limit_s):
    """Run ``script`` once per job, ``workers`` at a time, with ``base + job_args``
    (``jobs``: ``[(name, job_args)]``; each job's output goes to a log of its own, and
    ``{out}`` in its args becomes a scratch file). Returns ``{name: finished with rc 0}``;
    jobs still running after ``limit_s`` seconds are killed and count as not finished."""
    tmp = tempfile.mkdtemp(prefix="prewarm-")
    todo, running, done, t0 = list(jobs), [], {}, time.time()
    print(f"prewarm: {len(todo)} configurations, {workers} at a time", flush=True)
    while todo or running:
        while todo and len(running) < workers:
            name, extra = todo.pop(0)
            tag = "-".join(str(x) for x in (name if isinstance(name, tuple) else (name,)))
            out = os.path.join(tmp, f"{tag}.json")
            cmd = [sys.executable, script, *base, *[a.replace("{out}", out) for a in extra]]
            with open(os.path.join(tmp, f"{tag}.log"), "w") as log:   # the child keeps its copy
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            running.append((name, proc, time.time()))
        for item in list(running):
            name, proc, start = item
            if proc.poll() is not None:
                done[name] = proc.returncode == 0
                print(f"prewarm: {name} rc {proc.returncode} in {time.time() - start:.0f} s",
                      flush=True)
                running.remove(item)
        if time.time() - t0 > limit_s:
            for name, proc, start in running:
                proc.kill()
                proc.wait()
                done[name] = False
                print(f"prewarm: {name} stopped after {time.time() - start:.0f} s", flush=True)
            for name, _ in todo:
                done[name] = False
            break
        time.sleep(0.5)
    print(f"prewarm: {time.time() - t0:.0f} s", flush=True)
    return done
