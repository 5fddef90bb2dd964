"""Network safety: private Unix sockets by default, CURVE keys admit only authorized producers.

The attacks of issue 10, run by a hostile client against real processes, are in tests/e2e/test_hostile.py.
"""

from __future__ import annotations

import os
import stat

import pytest

from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.trainer import Trainer
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.sockets import endpoints, private_dir


def test_non_loopback_bind_needs_keys_or_an_explicit_flag():
    with pytest.raises(ValueError, match="refusing to bind 0.0.0.0.*--curve-dir.*--trusted-network"):
        Trainer(PipelineConfig(host="0.0.0.0"), TrainConfig())


def test_loopback_default_is_unix_sockets_in_a_private_directory(tmp_path):
    ep = endpoints(PipelineConfig(port=6000, runtime_dir=str(tmp_path / "run")))
    assert (ep.kind, ep.data, ep.control) == (
        "ipc",
        f"ipc://{tmp_path}/run/6000.data",
        f"ipc://{tmp_path}/run/6000.ctl",
    )
    assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o700
    # keys or an explicit --trusted-network mean tcp, on loopback too (e.g. an SSH tunnel)
    assert endpoints(PipelineConfig(port=6000, curve_dir=str(tmp_path))).data == "tcp://127.0.0.1:6000"
    assert endpoints(PipelineConfig(port=6000, trusted_network=True)).control == "tcp://127.0.0.1:6001"
    assert endpoints(PipelineConfig(host="::1", port=6000, trusted_network=True)).data == "tcp://[::1]:6000"


def test_a_runtime_directory_others_can_enter_is_refused(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    with pytest.raises(ValueError, match="open to other users.*chmod 700"):
        private_dir(open_dir)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    with pytest.raises(ValueError, match="symbolic link"):
        private_dir(link)
    if os.getuid() == 0:  # a directory another user made (e.g. squatting /tmp/lmpipe-<uid>)
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(ValueError, match="belongs to uid 65534"):
            private_dir(theirs)


def test_a_second_trainer_on_the_same_port_is_refused(tmp_path):
    cfg = PipelineConfig(port=6000, runtime_dir=str(tmp_path))
    first, second = endpoints(cfg), endpoints(cfg)
    first.claim(cfg.port)
    with pytest.raises(OSError, match="another trainer is using port 6000"):
        second.claim(cfg.port)
    first.release()
    second.claim(cfg.port)  # free again once the first one is done
    second.release()
