"""A small transformer language model on WikiText2, under the names of
`lightning.pytorch.demos.transformer`.

    from lightspeed.demos import LightningTransformer, WikiText2

    dataset = WikiText2()  # ./data/wikitext-2.txt, downloaded on first use
    model = LightningTransformer(vocab_size=dataset.vocab_size)
    Trainer(max_steps=100).fit(model)

`WikiText2` cuts the training text of WikiText-2 into blocks of `block_size` token ids; item i is
(block i, the same block shifted one token on). Offline, with no file on disk, it warns once and
builds a synthetic corpus of the same form instead (see `_synthetic_corpus`), so examples still run.

The model is an encoder-decoder `nn.Transformer` with Lightning's constructor arguments, sub-module
names (so state-dict keys match) and output: log-probabilities of shape (batch * time, vocab).
Where Lightning's demo lets a position see the token it must predict, this one masks the encoder
and the decoder causally and feeds the decoder the target shifted right, so its loss is honest.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightspeed.core.module import LightningModule
from lightspeed.demos._download import ensure_file

__all__ = [
    "Dictionary",
    "LightningTransformer",
    "PositionalEncoding",
    "Transformer",
    "WikiText2",
    "tokenize",
]

WIKITEXT2_URL = (
    "https://raw.githubusercontent.com/pytorch/examples/main/"
    "word_language_model/data/wikitext-2/train.txt"
)
WIKITEXT2_VOCAB_SIZE = 33278  # words in WikiText-2's training text, "<eos>" included


class Transformer(nn.Module):
    """Encoder-decoder transformer over token ids.

    Args:
        vocab_size: number of distinct token ids (WikiText-2's by default).
        ninp: embedding width (the transformer's d_model).
        nhead: attention heads.
        nhid: width of the feed-forward layers.
        nlayers: encoder layers, and as many decoder layers.
        dropout: dropout of the positional encoding and of every layer.
    """

    def __init__(
        self,
        vocab_size: int = WIKITEXT2_VOCAB_SIZE,
        ninp: int = 200,
        nhead: int = 2,
        nhid: int = 200,
        nlayers: int = 2,
        dropout: float = 0.2,
    ) -> None:
        super().__init__()
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        self.embedding = nn.Embedding(vocab_size, ninp)
        self.transformer = nn.Transformer(
            d_model=ninp,
            nhead=nhead,
            num_encoder_layers=nlayers,
            num_decoder_layers=nlayers,
            dim_feedforward=nhid,
            dropout=dropout,
            batch_first=True,
        )
        self.decoder = nn.Linear(ninp, vocab_size)
        self.ninp = ninp
        self.vocab_size = vocab_size

    def generate_square_subsequent_mask(self, size: int) -> Tensor:
        """An additive (size, size) float mask: 0 on and below the diagonal, -inf above it, so
        position i attends to positions 0..i only."""
        return torch.full((size, size), float("-inf")).triu(diagonal=1)

    def forward(self, inputs: Tensor, target: Tensor, mask: Tensor | None = None) -> Tensor:
        """Predict `target` from `inputs`.

        Args:
            inputs: (batch, time) int64 token ids.
            target: (batch, time) int64 token ids, `inputs` shifted one token on. The decoder reads
                it shifted right by one (teacher forcing), so no position sees its own answer.
            mask: the decoder's self-attention mask; causal when None.

        Returns:
            (batch * time, vocab_size) log-probabilities of the target tokens.
        """
        steps = inputs.size(1)
        causal = self.generate_square_subsequent_mask(steps).to(inputs.device)
        if mask is None:
            mask = causal
        decoder_input = torch.cat([inputs[:, :1], target[:, :-1]], dim=1)
        src = self.pos_encoder(self.embedding(inputs) * math.sqrt(self.ninp))
        tgt = self.pos_encoder(self.embedding(decoder_input) * math.sqrt(self.ninp))
        hidden = self.transformer(src, tgt, src_mask=causal, tgt_mask=mask, memory_mask=causal)
        logits = self.decoder(hidden)
        return F.log_softmax(logits, dim=-1).view(-1, self.vocab_size)


class PositionalEncoding(nn.Module):
    """Adds the sinusoidal position signal of "Attention Is All You Need", then dropout.

    The table is computed in each forward for the sequence at hand rather than kept: a buffer
    would be saved in checkpoints (Lightning's state-dict has none) and cost memory at max_len.

    Args:
        dim: the embedding width.
        dropout: dropout applied after adding the signal.
        max_len: the longest sequence accepted.
    """

    def __init__(self, dim: int, dropout: float = 0.1, max_len: int = 5000) -> None:
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        self.dim = dim
        self.max_len = max_len

    def forward(self, x: Tensor) -> Tensor:
        """x: (batch, time, dim) -> same shape, with the position signal added."""
        steps = x.size(1)
        if steps > self.max_len:
            raise ValueError(f"sequence of {steps} steps is longer than max_len={self.max_len}")
        position = torch.arange(steps, device=x.device, dtype=torch.float32).unsqueeze(1)
        even = torch.arange(0, self.dim, 2, device=x.device, dtype=torch.float32)
        angle = position * torch.exp(even * (-math.log(10000.0) / self.dim))
        table = torch.zeros(steps, self.dim, device=x.device)
        table[:, 0::2] = torch.sin(angle)
        table[:, 1::2] = torch.cos(angle[:, : self.dim // 2])
        return self.dropout(x + table.to(x.dtype))


class Dictionary:
    """Words to ids and back, ids given in order of first appearance."""

    def __init__(self) -> None:
        self.word2idx: dict[str, int] = {}
        self.idx2word: list[str] = []

    def add_word(self, word: str) -> int:
        """The id of `word`, which is added if new."""
        if word not in self.word2idx:
            self.word2idx[word] = len(self.idx2word)
            self.idx2word.append(word)
        return self.word2idx[word]

    def __len__(self) -> int:
        return len(self.idx2word)


def tokenize(path: Path) -> tuple[Tensor, Dictionary]:
    """Split a text file on whitespace, ending every line with "<eos>".

    Returns:
        The whole file as one 1-D int64 tensor of ids, and the dictionary that maps them.
    """
    dictionary = Dictionary()
    ids: list[int] = []
    with open(path, encoding="utf8") as f:
        for line in f:
            ids.extend(dictionary.add_word(word) for word in [*line.split(), "<eos>"])
    return torch.tensor(ids, dtype=torch.int64), dictionary


def _synthetic_corpus(
    num_tokens: int = 210_000, num_words: int = 1000, seed: int = 0
) -> tuple[Tensor, Dictionary]:
    """A deterministic stand-in for WikiText-2 when it cannot be downloaded.

    Words "w0".."w999" are drawn with Zipf-like frequencies (as in natural text, a few words are
    very common) into sentences of 4 to 24 words, each ended by "<eos>". The default length gives
    6000 blocks of 35, enough for Lightning's examples, which hold out 4000 blocks for val/test.
    """
    generator = torch.Generator().manual_seed(seed)
    dictionary = Dictionary()
    for word in [*(f"w{i}" for i in range(num_words)), "<eos>"]:
        dictionary.add_word(word)
    frequency = 1.0 / torch.arange(1, num_words + 1, dtype=torch.float64)
    ids = torch.multinomial(frequency, num_tokens, replacement=True, generator=generator)
    # Sentence ends: cumulative sums of random sentence lengths, marked with the "<eos>" id.
    lengths = torch.randint(5, 26, (num_tokens // 5,), generator=generator)
    ends = lengths.cumsum(0) - 1
    ids[ends[ends < num_tokens]] = dictionary.word2idx["<eos>"]
    return ids, dictionary


class WikiText2(Dataset):
    """WikiText-2's training text as (input, target) blocks of token ids.

    Args:
        data_dir: folder of "wikitext-2.txt".
        block_size: tokens per block.
        download: fetch the text when it is not in `data_dir`.

    Item i is (ids[i*b : (i+1)*b], ids[i*b+1 : (i+1)*b+1]) for block size b: two int64 tensors of
    shape (block_size,). Without the file (offline, or download=False) the corpus is synthetic
    and a warning says so.
    """

    def __init__(
        self, data_dir: Path | str = Path("./data"), block_size: int = 35, download: bool = True
    ) -> None:
        super().__init__()
        self.path = Path(data_dir) / "wikitext-2.txt"
        self.block_size = block_size
        if ensure_file(WIKITEXT2_URL, self.path, download, what="WikiText2"):
            self.data, self.dictionary = tokenize(self.path)
        else:
            self.data, self.dictionary = _synthetic_corpus()

    @property
    def vocab_size(self) -> int:
        """The number of distinct words in the corpus."""
        return len(self.dictionary)

    def __len__(self) -> int:
        # One block is held back so that the last target, shifted one token on, stays in range.
        return len(self.data) // self.block_size - 1

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.block_size
        end = start + self.block_size
        return self.data[start:end], self.data[start + 1 : end + 1]


class LightningTransformer(LightningModule):
    """`Transformer` trained on WikiText2 with SGD (lr 0.1), one block per batch.

    `training_step` returns the negative log-likelihood of the targets and logs nothing, as
    Lightning's demo does.
    """

    def __init__(self, vocab_size: int = WIKITEXT2_VOCAB_SIZE) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=vocab_size)

    def forward(self, inputs: Tensor, target: Tensor) -> Tensor:
        return self.model(inputs, target)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, target = batch
        return F.nll_loss(self(inputs, target), target.view(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def prepare_data(self) -> None:
        WikiText2(download=True)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(WikiText2())
