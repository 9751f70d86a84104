"""The one helper that starts real ranks: it runs tests/workload.py (or another script) as a subprocess.

With `devices > 1` the Trainer itself spawns the other local ranks on 127.0.0.1 with a free port (gloo on CPU);
`launcher="torchrun"` starts the same script under torchrun instead. Nothing in torch.distributed is mocked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "tests" / "workload.py"


def run_workload(tmp_path: Path, timeout: float = 300, launcher: str = "python", nproc: int = 2,
                 extra_env: dict | None = None, check: bool = True, **opts) -> dict:
    """Runs the workload with `opts`; returns rank 0's JSON result (or the CompletedProcess if check=False)."""
    out = tmp_path / f"result-{len(list(tmp_path.glob('result-*')))}.json"
    opts.setdefault("root", str(tmp_path))
    opts["out"] = str(out)
    cmd = [sys.executable, str(WORKLOAD), json.dumps(opts)]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *cmd[1:]]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **(extra_env or {})}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    if not check:
        return proc  # type: ignore[return-value]
    if proc.returncode != 0:
        raise AssertionError(f"workload failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def _free_port() -> int:
    sys.path.insert(0, str(ROOT / "src"))
    from lightspeed.launch import find_free_port

    return find_free_port()


def assert_close_losses(a: list[float], b: list[float], rtol: float, what: str = "") -> None:
    """Per-step losses equal within a relative tolerance; reports the worst step."""
    assert len(a) == len(b) and a, f"{what}: {len(a)} vs {len(b)} steps"
    worst = max(range(len(a)), key=lambda i: abs(a[i] - b[i]) / max(abs(b[i]), 1e-12))
    rel = abs(a[worst] - b[worst]) / max(abs(b[worst]), 1e-12)
    assert rel <= rtol, f"{what}: step {worst} differs by {rel:.2e} (> {rtol:.0e}): {a[worst]} vs {b[worst]}"
