"""Hypothesis strategies for what a peer may pack onto the control channel: any msgpack map with a message
type (a real one or not) and any values under the fields the control messages have."""

from __future__ import annotations

from hypothesis import strategies as st

from lmpipe.shared import messages

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=20),
    st.binary(max_size=20),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), st.binary(max_size=8)), inner, max_size=4),
    ),
    max_leaves=12,
)
HELLO_FIELDS = ["producer", "fingerprint", "pid", "host", "session", "rejoin", "holding", "wire"]
control_maps = st.fixed_dictionaries(
    {"type": st.sampled_from([*messages.TYPES, "bogus"])},
    optional={
        f: values
        for f in [*HELLO_FIELDS, "cursor", "reason", "next_seq", "force", "shards", "total", "lease"]
    },
)
