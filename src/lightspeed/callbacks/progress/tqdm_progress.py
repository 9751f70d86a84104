"""TQDMProgressBar: Lightning's default bar, drawn with tqdm: one bar for training (an epoch's
batches), one for validation under it, one each for test and predict.

    Trainer(callbacks=[TQDMProgressBar(refresh_rate=10)])   # redraw every 10 batches

Given to the Trainer it draws instead of lightspeed's own bar (a rich bar, or periodic lines
without a terminal). `refresh_rate=0` draws nothing; the environment's `TQDM_MINITERS` raises the
rate, and on Colab (`COLAB_GPU`) the default rate is 20, as in Lightning.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from lightspeed.callbacks.progress.progress_bar import ProgressBar, convert_inf

_TQDM_AVAILABLE = importlib.util.find_spec("tqdm") is not None
if _TQDM_AVAILABLE:
    from tqdm import tqdm as _tqdm
else:  # the bar needs tqdm; the class still defines, so the name imports
    _tqdm = object  # type: ignore[assignment,misc]

_PAD_SIZE = 5


class Tqdm(_tqdm):  # type: ignore[misc,valid-type]
    """tqdm whose numbers keep a steady width: floats and numeric strings get 3 decimals."""

    @staticmethod
    def format_num(n: int | float | str) -> str:
        """1 -> "1", 1.0 -> "1.000", 0.1 -> "0.100", 1e-5 -> "1e-5", "abc" -> "abc"."""
        padded = isinstance(n, (float, str))
        plain_format = getattr(_tqdm, "format_num", str)  # tqdm's: 3 significant digits
        text = n if isinstance(n, str) else plain_format(n)
        if padded and "e" not in text:
            if "." not in text and len(text) < _PAD_SIZE:
                try:
                    float(text)
                except ValueError:
                    return text
                text += "."
            text += "0" * (_PAD_SIZE - len(text))
        return text


class TQDMProgressBar(ProgressBar):
    """Lightning's tqdm bar. `refresh_rate`: redraw every n batches (0: off); `process_position`:
    the bars' line offset (several trainers in one terminal); `leave`: keep each epoch's bar."""

    draws_itself = True
    BAR_FORMAT = (
        "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"
    )

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False):
        super().__init__()
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 0:
            from lightspeed.errors import ConfigError

            raise ConfigError(
                f"refresh_rate={refresh_rate!r} is not valid: expected an integer ≥ 0 (0: no bar)."
            )
        self._refresh_rate = self._resolve_refresh_rate(refresh_rate)
        self._process_position, self._leave = process_position, leave
        self._enabled = True
        self._train_progress_bar: Any = None
        self._val_progress_bar: Any = None
        self._test_progress_bar: Any = None
        self._predict_progress_bar: Any = None

    @staticmethod
    def _resolve_refresh_rate(refresh_rate: int) -> int:
        if os.getenv("COLAB_GPU") and refresh_rate == 1:
            return 20  # Colab's output cell slows down with frequent redraws
        if "TQDM_MINITERS" in os.environ:
            return max(int(os.environ["TQDM_MINITERS"]), refresh_rate)
        return refresh_rate

    def __getstate__(self) -> dict:
        # tqdm bars hold the terminal: a pickled callback leaves them out
        state = super().__getstate__()
        return {k: (None if k.endswith("_progress_bar") else v) for k, v in state.items()}

    # ------------------------------------------------------------------ the bars
    def _bar(self, name: str) -> Any:
        bar = getattr(self, f"_{name}_progress_bar")
        if bar is None:
            raise TypeError(
                f"The `{type(self).__name__}._{name}_progress_bar` reference has not been set yet."
            )
        return bar

    train_progress_bar = property(
        lambda self: self._bar("train"),
        lambda self, bar: setattr(self, "_train_progress_bar", bar),
    )
    val_progress_bar = property(
        lambda self: self._bar("val"), lambda self, bar: setattr(self, "_val_progress_bar", bar)
    )
    test_progress_bar = property(
        lambda self: self._bar("test"), lambda self, bar: setattr(self, "_test_progress_bar", bar)
    )
    predict_progress_bar = property(
        lambda self: self._bar("predict"),
        lambda self, bar: setattr(self, "_predict_progress_bar", bar),
    )

    @property
    def refresh_rate(self) -> int:
        return self._refresh_rate

    @property
    def process_position(self) -> int:
        return self._process_position

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.refresh_rate > 0

    @property
    def is_disabled(self) -> bool:
        return not self.is_enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def _tqdm(self, desc: str, position: int, leave: bool, **kwargs: Any) -> Tqdm:
        return Tqdm(
            desc=desc,
            position=position,
            disable=self.is_disabled,
            leave=leave,
            dynamic_ncols=True,
            file=sys.stdout,
            **kwargs,
        )

    def init_sanity_tqdm(self) -> Tqdm:
        return self._tqdm(self.sanity_check_description, 2 * self.process_position, False)

    def init_train_tqdm(self) -> Tqdm:
        return self._tqdm(
            self.train_description,
            2 * self.process_position,
            True,
            smoothing=0,
            bar_format=self.BAR_FORMAT,
        )

    def init_predict_tqdm(self) -> Tqdm:
        return self._tqdm(
            self.predict_description,
            2 * self.process_position,
            True,
            smoothing=0,
            bar_format=self.BAR_FORMAT,
        )

    def init_validation_tqdm(self) -> Tqdm:
        under_main = self.trainer.state.fn != "validate"  # below the training bar while fitting
        return self._tqdm(
            self.validation_description,
            2 * self.process_position + under_main,
            not under_main,
            bar_format=self.BAR_FORMAT,
        )

    def init_test_tqdm(self) -> Tqdm:
        return self._tqdm(
            self.test_description, 2 * self.process_position, True, bar_format=self.BAR_FORMAT
        )

    def _should_update(self, current: int, total: int | float | None) -> bool:
        return self.is_enabled and (current % self.refresh_rate == 0 or current == total)

    @staticmethod
    def _update_n(bar: Any, value: int) -> None:
        if not bar.disable:
            bar.n = value
            bar.refresh()

    def _reset(self, bar: Any, total: int | float | None, desc: str) -> None:
        bar.reset(convert_inf(total))
        bar.initial = 0
        bar.set_description(desc)

    # ------------------------------------------------------------------ sanity check and training
    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        self.val_progress_bar = self.init_sanity_tqdm()
        self.val_progress_bar.total = convert_inf(sum(trainer.num_sanity_val_batches))
        self.train_progress_bar = Tqdm(disable=True)  # a stand-in while the sanity check runs

    def on_sanity_check_end(self, trainer: Any, pl_module: Any) -> None:
        self.val_progress_bar.close()
        self.train_progress_bar.close()
        self.reset_dataloader_idx_tracker()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.train_progress_bar = self.init_train_tqdm()

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        self._reset(
            self.train_progress_bar, self.total_train_batches, f"Epoch {trainer.current_epoch}"
        )

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        n = batch_idx + 1
        if self._should_update(n, self.train_progress_bar.total):
            self._update_n(self.train_progress_bar, n)
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
        if self._leave:
            self.train_progress_bar.close()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.train_progress_bar.close()

    # ------------------------------------------------------------------ evaluation
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.val_progress_bar = self.init_validation_tqdm()

    def on_validation_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.has_dataloader_changed(dataloader_idx):
            desc = (
                self.sanity_check_description
                if trainer.sanity_checking
                else self.validation_description
            )
            self._reset(
                self.val_progress_bar,
                self.total_val_batches_current_dataloader,
                self._described(desc, trainer.num_val_batches, dataloader_idx),
            )

    def on_validation_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        n = batch_idx + 1
        if self._should_update(n, self.val_progress_bar.total):
            self._update_n(self.val_progress_bar, n)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._train_progress_bar is not None and trainer.state.fn == "fit":
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
        self.val_progress_bar.close()
        self.reset_dataloader_idx_tracker()

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self.test_progress_bar = self.init_test_tqdm()

    def on_test_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.has_dataloader_changed(dataloader_idx):
            desc = self._described(self.test_description, trainer.num_test_batches, dataloader_idx)
            self._reset(self.test_progress_bar, self.total_test_batches_current_dataloader, desc)

    def on_test_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        n = batch_idx + 1
        if self._should_update(n, self.test_progress_bar.total):
            self._update_n(self.test_progress_bar, n)

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self.test_progress_bar.close()
        self.reset_dataloader_idx_tracker()

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self.predict_progress_bar = self.init_predict_tqdm()

    def on_predict_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.has_dataloader_changed(dataloader_idx):
            desc = self._described(
                self.predict_description, trainer.num_predict_batches, dataloader_idx
            )
            self._reset(
                self.predict_progress_bar, self.total_predict_batches_current_dataloader, desc
            )

    def on_predict_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        n = batch_idx + 1
        if self._should_update(n, self.predict_progress_bar.total):
            self._update_n(self.predict_progress_bar, n)

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        self.predict_progress_bar.close()
        self.reset_dataloader_idx_tracker()

    @staticmethod
    def _described(desc: str, counts: list, dataloader_idx: int) -> str:
        return f"{desc} DataLoader {dataloader_idx}" if len(counts) > 1 else desc

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        """Prints above the active bar (tqdm.write), so the bar is not broken."""
        trainer, bar = self._trainer, None
        if trainer is not None:
            if trainer.sanity_checking or trainer.validating:
                bar = self._val_progress_bar
            elif trainer.testing:
                bar = self._test_progress_bar
            elif trainer.predicting:
                bar = self._predict_progress_bar
            elif trainer.training:
                bar = self._train_progress_bar
        if bar is None or bar.disable:
            print(*args, sep=sep, **kwargs)
        else:
            bar.write(sep.join(map(str, args)), **kwargs)


__all__ = ["TQDMProgressBar", "Tqdm"]
