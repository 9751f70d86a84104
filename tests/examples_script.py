"""Scripts of examples/ run one after another in the same ranks (one interpreter start-up and one
rendezvous for them all): `python tests/examples_script.py '<json list of jobs>'`.

A job is {"script": a path, "args": its command-line arguments, "dir": the folder it runs in}. The
script runs as `python <script> <args>` runs it, in `dir`: its file executed as `__main__` (a
module of its own in sys.modules while it runs), its argparse reading `args`. The Trainer of the
first job starts rank 1 as this script with the same jobs, so every rank runs every job. Rank 0
prints "[examples_script job <i>]" before job i: where the job's output starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path


def run(job: dict) -> None:
    os.chdir(job["dir"])
    parse = argparse.ArgumentParser.parse_args

    def given(self, args=None, namespace=None):
        return parse(self, job["args"] if args is None else args, namespace)

    runner = sys.modules["__main__"]
    script = types.ModuleType("__main__")
    script.__file__ = job["script"]
    argparse.ArgumentParser.parse_args = given
    sys.modules["__main__"] = script
    try:
        code = compile(Path(job["script"]).read_text(), job["script"], "exec")
        exec(code, script.__dict__)
    finally:
        sys.modules["__main__"] = runner
        argparse.ArgumentParser.parse_args = parse


if __name__ == "__main__":
    for i, job in enumerate(json.loads(sys.argv[1])):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[examples_script job {i}]", flush=True)
        run(job)
