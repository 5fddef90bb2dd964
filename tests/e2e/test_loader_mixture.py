"""A mixture through the library's Loader: the batches follow the mixture, and a Loader resumed from the
state_dict saved after batch k yields exactly the batches an uninterrupted one yields after it (the
mixer's state travels in the state, beside every source's cursors)."""

from __future__ import annotations

import torch

from lmpipe import Loader
from tests.mixruns import corpus


def batches(loader: Loader, n: int) -> list[torch.Tensor]:
    out = []
    for batch in loader:
        out.append(batch["input_ids"].clone())
        if len(out) == n:
            break
    return out


def test_a_resumed_mixture_loader_yields_the_uninterrupted_batches(tmp_path, port):
    files = corpus(tmp_path)

    def loader() -> Loader:
        mix = [f"{n}={p}:{w}" for (n, p), w in zip(files.items(), (0.5, 0.3, 0.2))]
        return Loader(mix=mix, seq_len=32, batch_size=4, producers=2, shards=2, epochs=0, seed=7, port=port,
                      device="cpu", metrics_port=-1)  # fmt: skip

    with loader() as whole:
        want = batches(whole, 12)
    with loader() as first:
        got = batches(first, 5)
        state = first.state_dict()
    assert "mix" in state["cursors"], "the mixer's state is in the Loader's"
    again = loader()
    again.load_state_dict(state)
    with again:
        got += batches(again, 7)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(want) == 12
