"""Lightning's Trainer arguments that stand for other flags, turned into them at the door before any
rank starts: `plugins=...` (`plugin_flags`, from `config.parse_flags`) and `barebones=True`
(`barebones_flags`, from the Trainer, which also holds `logger` and `profiler`). What no flag can
say is a ConfigError naming the argument and what to do."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightspeed.errors import ConfigError
from lightspeed.plugins import environments, io, layer_sync, precision
from lightspeed.specs import PRECISION_ALIASES

KINDS = {
    "precision": precision.Precision,
    "cluster environment": environments.ClusterEnvironment,
    "checkpoint IO": io.CheckpointIO,
    "layer sync": layer_sync.LayerSync,
}
PRECISIONS = (
    precision.Precision,
    precision.MixedPrecision,
    precision.HalfPrecision,
    precision.DoublePrecision,
    precision.DeepSpeedPrecision,
    precision.FSDPPrecision,
)


def plugin_flags(plugins: Any, flags: dict[str, Any]) -> dict[str, Any]:
    """The Trainer flags `plugins` (one plugin or several) set, checked against `flags` (what the
    call passed): `precision`, `sync_batchnorm`, `preemption_signals`, `requeue`."""
    if plugins is None:
        return {}
    items = [plugins] if not isinstance(plugins, Iterable) or isinstance(plugins, str) else plugins
    seen: dict[str, Any] = {}
    for plugin in items:
        kind = next((k for k, base in KINDS.items() if isinstance(plugin, base)), None)
        if kind is None:
            raise ConfigError(
                f"plugins contains {plugin!r}, which is not valid: expected a precision plugin "
                "(MixedPrecision, HalfPrecision, DeepSpeedPrecision, ...), a cluster environment, "
                "TorchCheckpointIO or TorchSyncBatchNorm from lightspeed.plugins."
            )
        if kind in seen:
            raise ConfigError(
                f"plugins has two {kind} plugins ({seen[kind]!r} and {plugin!r}): give one."
            )
        seen[kind] = plugin
    out: dict[str, Any] = {}
    if (p := seen.get("precision")) is not None:
        out.update(_precision(p, flags))
    if (e := seen.get("cluster environment")) is not None:
        out.update(_environment(e, flags))
    if (c := seen.get("checkpoint IO")) is not None and type(c) not in (io.TorchCheckpointIO,):
        raise ConfigError(
            f"plugins={c!r} is not taken: lightspeed writes checkpoints itself (collective, "
            "atomic, checksummed; docs/porting.md). Leave it out, or pass TorchCheckpointIO()."
        )
    if (s := seen.get("layer sync")) is not None:
        if type(s) is not layer_sync.TorchSyncBatchNorm:
            raise ConfigError(
                f"plugins={s!r} is not taken: the one layer sync is TorchSyncBatchNorm() "
                "(Trainer(sync_batchnorm=True))."
            )
        out["sync_batchnorm"] = True
    return out


def _precision(p: precision.Precision, flags: dict[str, Any]) -> dict[str, Any]:
    if type(p) not in PRECISIONS:
        raise ConfigError(
            f"plugins={p!r} is not taken: "
            + (
                "lightspeed does not provide it."
                if isinstance(p, precision.NOT_PROVIDED)
                else "a precision plugin of your own is not run here (the strategy owns casting "
                "and scaling)."
            )
            + " Use Trainer(precision=...) with '32-true', 'bf16-mixed', '16-mixed' or 'bf16-true'."
        )
    if p.precision not in PRECISION_ALIASES:
        raise ConfigError(
            f"plugins={p!r} is not taken: lightspeed does not run precision {p.precision!r}. Use "
            "Trainer(precision=...) with '32-true', 'bf16-mixed', '16-mixed' or 'bf16-true'."
        )
    if "precision" in flags:
        raise ConfigError(
            f"precision={flags['precision']!r} and plugins={p!r} both set the precision: give one."
        )
    if getattr(p, "scaler", None) is not None:
        raise ConfigError(
            f"{type(p).__name__}(scaler=...) is not taken: under '16-mixed' lightspeed builds "
            "torch's GradScaler itself. Leave scaler out."
        )
    return {"precision": p.precision}


def _environment(e: environments.ClusterEnvironment, flags: dict[str, Any]) -> dict[str, Any]:
    if type(e) not in environments.READ:
        raise ConfigError(
            f"plugins={e!r} is not taken: lightspeed reads the launch environment itself, from "
            "torchrun's, the deepspeed launcher's or SLURM's variables (or starts the ranks "
            "itself). Launch with one of those, and leave the environment plugin out."
        )
    if not isinstance(e, environments.SLURMEnvironment):
        return {}
    out: dict[str, Any] = {"requeue": bool(e.auto_requeue)}
    if e.requeue_signal is not None:
        if "preemption_signals" in flags:
            raise ConfigError(
                f"preemption_signals={flags['preemption_signals']!r} and "
                f"SLURMEnvironment(requeue_signal={e.requeue_signal!r}) both set the signals: "
                "give one."
            )
        out["preemption_signals"] = ("SIGTERM", e.requeue_signal.name)
    return out


# Lightning's barebones=True: what it switches off, and the value each of these flags must keep
BAREBONES = {
    "enable_checkpointing": (False, "checkpointing"),
    "enable_progress_bar": (False, "the progress bar"),
    "enable_model_summary": (False, "the model summary"),
    "log_every_n_steps": (0, "logging"),
    "num_sanity_val_steps": (0, "the sanity check"),
    "fast_dev_run": (False, "a development run"),
    "detect_anomaly": (False, "anomaly detection"),
}


def barebones_flags(flags: dict[str, Any], logger: Any, profiler: Any) -> dict[str, Any]:
    """Under `barebones=True` (Lightning's mode for measuring the Trainer's own overhead): `flags`
    with checkpointing, the bar, the model summary, logging and the sanity check off. A flag (or
    a logger, a profiler) that asks for one of them is a ConfigError naming it; `self.log` warns
    and records nothing, and no run report is written."""
    if not flags.get("barebones"):
        return flags
    for name, (off, what) in BAREBONES.items():
        if flags.get(name) not in (None, off):
            raise ConfigError(
                f"barebones=True with {name}={flags[name]!r}: barebones switches {what} off (it "
                f"would cost speed). Leave {name} out, or use barebones=False."
            )
    # the Trainer's default logger=True stands for "none given"
    for name, value, allowed in (
        ("logger", logger, (None, False, True)),
        ("profiler", profiler, (None,)),
    ):
        if value not in allowed:
            raise ConfigError(
                f"barebones=True with {name}={value!r}: barebones switches logging and profiling "
                f"off (they would cost speed). Leave {name} out, or use barebones=False."
            )
    off = {name: value for name, (value, _) in BAREBONES.items() if name != "log_every_n_steps"}
    kept = {k: v for k, v in flags.items() if k != "log_every_n_steps"}  # no logger reads it
    return {**kept, **off}
