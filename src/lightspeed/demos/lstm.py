"""An LSTM language model on WikiText2 with truncated back-propagation through time, under the
names of `lightning.pytorch.demos.lstm`.

    from lightspeed.demos import LightningLSTM

    Trainer(max_steps=100).fit(LightningLSTM())

`SequenceSampler` makes each row of a batch a continuous stream of the text, so the hidden state
left by one batch is the right start for the next; `LightningLSTM` carries it over (detached, so
gradients stop at the batch) and clears it at the end of every epoch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, Sampler

from lightspeed.core.module import LightningModule
from lightspeed.demos.transformer import WIKITEXT2_VOCAB_SIZE, WikiText2

__all__ = ["LightningLSTM", "SequenceSampler", "SimpleLSTM"]


class SimpleLSTM(nn.Module):
    """Embedding, a stacked LSTM and a linear read-out to the vocabulary.

    Args:
        vocab_size: number of distinct token ids (WikiText-2's by default).
        ninp: embedding width.
        nhid: hidden width of each LSTM layer.
        nlayers: stacked LSTM layers.
        dropout: dropout on the embeddings, between the LSTM layers and on its output.
    """

    def __init__(
        self,
        vocab_size: int = WIKITEXT2_VOCAB_SIZE,
        ninp: int = 512,
        nhid: int = 512,
        nlayers: int = 4,
        dropout: float = 0.2,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.nlayers = nlayers
        self.nhid = nhid
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab_size, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(nhid, vocab_size)
        self.init_weights()

    def init_weights(self) -> None:
        """Small uniform weights for the embedding and the read-out, a zero read-out bias."""
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(
        self, input: Tensor, hidden: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """One pass over a batch of sequences.

        Args:
            input: (batch, time) int64 token ids.
            hidden: (h, c), each (nlayers, batch, nhid), e.g. from `init_hidden`.

        Returns:
            (batch * time, vocab_size) log-probabilities of the next token, and the new (h, c).
        """
        embedded = self.drop(self.encoder(input))
        output, hidden = self.rnn(embedded, hidden)
        logits = self.decoder(self.drop(output)).view(-1, self.vocab_size)
        return F.log_softmax(logits, dim=1), hidden

    def init_hidden(self, batch_size: int) -> tuple[Tensor, Tensor]:
        """Zero (h, c) states for `batch_size` sequences, on the model's device and dtype."""
        weight = next(self.parameters())
        shape = (self.nlayers, batch_size, self.nhid)
        return weight.new_zeros(shape), weight.new_zeros(shape)


class SequenceSampler(Sampler[list[int]]):
    """Batches in which row r reads the r-th stretch of the dataset, in order.

    The dataset's n items are cut into `batch_size` stretches of n // batch_size items (the last
    n % batch_size are dropped). Batch i holds item i of every stretch, so consecutive batches
    continue each row where the previous one stopped.
    """

    def __init__(self, dataset: Sized, batch_size: int) -> None:
        super().__init__()
        self.dataset = dataset
        self.batch_size = batch_size
        self.chunk_size = len(dataset) // batch_size

    def __iter__(self) -> Iterator[list[int]]:
        for i in range(self.chunk_size):
            yield [i + row * self.chunk_size for row in range(self.batch_size)]

    def __len__(self) -> int:
        return self.chunk_size


class LightningLSTM(LightningModule):
    """`SimpleLSTM` trained on WikiText2 in batches of 20 streams, SGD with lr 20.

    `training_step` logs "train_loss" (also to the progress bar) and returns it.
    """

    def __init__(self, vocab_size: int = WIKITEXT2_VOCAB_SIZE) -> None:
        super().__init__()
        self.model = SimpleLSTM(vocab_size=vocab_size)
        self.hidden: tuple[Tensor, Tensor] | None = None

    def on_train_epoch_end(self) -> None:
        # The next epoch starts the streams from their beginnings: the carried state is stale.
        self.hidden = None

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        input, target = batch
        if self.hidden is None:
            self.hidden = self.model.init_hidden(input.size(0))
        # Keep the state's values, cut its graph: back-propagation stops at this batch.
        hidden = (self.hidden[0].detach(), self.hidden[1].detach())
        output, self.hidden = self.model(input, hidden)
        loss = F.nll_loss(output, target.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def prepare_data(self) -> None:
        WikiText2(download=True)

    def train_dataloader(self) -> DataLoader:
        dataset = WikiText2()
        return DataLoader(dataset, batch_sampler=SequenceSampler(dataset, batch_size=20))

    def configure_optimizers(self) -> Optimizer:
        return torch.optim.SGD(self.parameters(), lr=20.0)
