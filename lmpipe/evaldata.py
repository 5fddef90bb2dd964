"""The held-out batches of `--eval-data`, read once by the launcher before anything starts.

Design: the trainer must not import the producer (layering), yet its evaluation batches should be made
exactly as training batches are. So the launcher (this layer, above both) opens --eval-data with the
producers' own code (Corpus, DocStream, batching: the same tokenizer, --strategy, --seq-len, --batch-size),
takes the first --eval-batches batches of its first epoch in the corpus's order (no shuffle), and hands them
to the trainer as plain `shared.batch.Batch` arrays. They are the same every evaluation, and after a resume,
so the eval losses of a run (and of runs with the same batching settings) compare. A mistake in
--eval-data is one line before any process starts, as with --data.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING

from lmpipe.consumer.config import TrainConfig
from lmpipe.shared.batch import Batch, token_dtype
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.settings import SettingsError, show
from lmpipe.shared.tokenizer import TokenizerInfo

if TYPE_CHECKING:
    from lmpipe.producer.sources import Corpus

log = logging.getLogger("lmpipe")


def check_held_out(cfg: PipelineConfig, tcfg: TrainConfig, tok: TokenizerInfo) -> Corpus | None:
    """--eval-data opens and holds a document (read, not tokenized: `lmpipe run` checks it before it forks
    its producers, and the tokenizers library's threads must not exist in the process they fork from)."""
    if not tcfg.eval_data or tcfg.consume_only:
        return None
    from lmpipe.checks import check_corpus

    ecfg = replace(cfg, data=list(tcfg.eval_data), mix=[], mix_file=None, producers=1, rank=0, world_size=1)
    try:
        corpus = check_corpus(ecfg, tok).corpora[0]
    except SettingsError as exc:
        raise SettingsError(str(exc).replace("--data", "--eval-data")) from None
    if shared := _shared_files(cfg, tcfg):
        log.warning("--eval-data %s is also in --data: its loss is not on held-out text", shared)
    return corpus


def held_out(cfg: PipelineConfig, tcfg: TrainConfig) -> list[Batch]:
    """The first --eval-batches batches of --eval-data (none without it), tokenized here."""
    from lmpipe.checks import check_tokenizer
    from lmpipe.producer.batching import BatchSpec, batches
    from lmpipe.producer.stream import DocStream

    tok = check_tokenizer(cfg)
    corpus = check_held_out(cfg, tcfg, tok)
    if corpus is None:
        return []
    stream = DocStream(corpus, tok, shuffle_window=0, seed=cfg.seed)
    made = batches(stream, BatchSpec.of(cfg), epochs=1, dtype=token_dtype(tok.vocab_size))
    out = list(itertools.islice(made, tcfg.eval_batches))
    if not out:
        raise SettingsError(f"--eval-data {show(tcfg.eval_data)}: no batch could be made of it")
    if len(out) < tcfg.eval_batches:
        log.info("--eval-data: %d batches, all of %s (fewer than --eval-batches %d)",
                 len(out), show(tcfg.eval_data), tcfg.eval_batches)  # fmt: skip
    return out


def _shared_files(cfg: PipelineConfig, tcfg: TrainConfig) -> str:
    """A path named both in --eval-data and in --data (or a mixture's sources), if any."""
    train = {os.path.realpath(p) for p in cfg.all_data() if "://" not in p}
    both = [p for p in tcfg.eval_data if "://" not in p and os.path.realpath(p) in train]
    return both[0] if both else ""


def describe(batches: list[Batch], tcfg: TrainConfig) -> str:
    """What the evaluation scores, for --dry-run and the log."""
    targets = sum(b.num_targets() for b in batches)
    return (
        f"evaluation every {tcfg.eval_every} steps and at the end: {len(batches)} batches of "
        f"{show(tcfg.eval_data)} ({targets:,} targets)"
    )
