"""Settings: each dataclass field is the one definition of its flag, variable, default and check."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from lmpipe.cli import build_parser
from lmpipe.consumer.config import MODELS, TrainConfig
from lmpipe.options import GlobalOptions, ProduceOptions, ReportOptions
from lmpipe.producer.batching import BatchSpec
from lmpipe.shared.config import PipelineConfig, pipeline_argv
from lmpipe.shared.settings import SettingsError, from_args, name_sources, specs, to_argv
from tests.helpers import REPO


@pytest.fixture
def env(monkeypatch):
    """A clean LMPIPE_* environment; returns a setter."""
    import os

    for k in [k for k in os.environ if k.startswith("LMPIPE_")]:
        monkeypatch.delenv(k)
    return monkeypatch.setenv


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def as_env(cfg) -> dict[str, str]:
    """The LMPIPE_* variables that say what `cfg` says."""
    out = {}
    for s in specs(type(cfg)):
        v = getattr(cfg, s.name)
        if s.env is None:
            continue
        out[s.env] = (
            ("1" if v else "0") if s.type is bool else " ".join(v) if s.many else "" if v is None else str(v)
        )
    return out


# Every field changed from its default (and valid), so a setting that does not travel shows up.
PIPELINE = PipelineConfig(
    data=["a.txt", "b.jsonl"], tokenizer="tok.json", strategy="bucket", seq_len=64, batch_size=3, bucket_k=5,
    bucket_window=77, pad_multiple=8, seed=4, shuffle_window=9, doc_split="heading", text_column="body",
    builtin_docs=123,
    epochs=2, producers=3, rank=1, world_size=2, host="gpu-host", port=6000, trusted_network=True,
    curve_dir=None, runtime_dir="/run/x", metrics_host="0.0.0.0", max_line_bytes=999,
)  # fmt: skip
TRAIN = TrainConfig(
    model="small", consume_only=True, steps=7, accum=2, keep_global_batch=True, lr=1e-4, min_lr_ratio=0.5, warmup=3, lr_decay_steps=50, weight_decay=0.0,
    beta1=0.8, beta2=0.9, grad_clip=0.5, device="cpu", precision="bf16", residual_dtype="bf16", loss_scale="static:128",
    fused_ce=True, fast="none", vocab_size=512, attention="dense", hf_attention="eager", fused_adamw=False, grad_checkpointing=True, compile=True, compile_mode="max-autotune", compile_scope="blocks",
    compile_cache="cc", compile_ahead=False,
    grad_reduce="bf16", copy_stream=False, tf32=False, log_every=2, slots=6, threads=1, seed=9, metrics_port=-1, shards=5, doc_log="d.jsonl",
    wait_timeout=1.5, checkpoint_dir="ck", checkpoint_every=5, keep_checkpoints=2, resume="auto", checkpoint_mode="async",
    eval_data=["held.txt", "held2.jsonl"], eval_every=7, eval_batches=3, log_to=["tensorboard:tb", "wandb:proj"],
)  # fmt: skip


def test_the_examples_change_every_field():
    for example in (PIPELINE, TRAIN):
        default = type(example)()
        same = [f.name for f in fields(example) if getattr(example, f.name) == getattr(default, f.name)]
        # curve_dir must name an existing directory; --mix and --mix-file exclude --data (test_mix_spec.py
        # makes them travel)
        assert set(same) <= {"curve_dir", "mix", "mix_file"}, same


def test_no_flags_and_no_environment_give_the_dataclass_defaults(env):
    ns = parse("run")
    assert from_args(ns, PipelineConfig) == PipelineConfig()
    assert from_args(ns, TrainConfig) == TrainConfig()
    assert from_args(ns, ReportOptions) == ReportOptions()
    assert from_args(ns, GlobalOptions) == GlobalOptions()
    assert from_args(parse("produce"), ProduceOptions) == ProduceOptions()


@pytest.mark.parametrize("cmd", ["run", "train"])
def test_every_setting_comes_from_its_flag_or_its_variable(env, cmd):
    argv = [cmd, *to_argv(PIPELINE), *to_argv(TRAIN)]
    ns = parse(*argv)
    assert (from_args(ns, PipelineConfig), from_args(ns, TrainConfig)) == (PIPELINE, TRAIN)
    for k, v in {**as_env(PIPELINE), **as_env(TRAIN)}.items():
        env(k, v)
    ns = parse(cmd)
    assert (from_args(ns, PipelineConfig), from_args(ns, TrainConfig)) == (PIPELINE, TRAIN)


def test_a_flag_wins_over_the_environment(env):
    env("LMPIPE_SEQ_LEN", "64")
    env("LMPIPE_LR", "0.1")
    env("LMPIPE_TF32", "0")
    ns = parse("run", "--seq-len", "32", "--tf32")
    assert from_args(ns, PipelineConfig).seq_len == 32
    tcfg = from_args(ns, TrainConfig)
    assert tcfg.lr == 0.1 and tcfg.tf32 is True


def test_the_flags_that_always_worked_still_do(env):
    ns = parse(
        "train", "--no-tf32", "--no-fused-adamw", "--no-copy-stream", "--train-seed", "7", "--compile",
        "--fused-ce", "--grad-checkpointing", "--trusted-network", "--seed", "3", "--metrics-port", "-1",
        "--doc-split", "line", "--data", "x.txt", "y.txt", "--tokenizer", "t.json",
    )  # fmt: skip
    tcfg, cfg = from_args(ns, TrainConfig), from_args(ns, PipelineConfig)
    assert (tcfg.tf32, tcfg.fused_adamw, tcfg.copy_stream) == (False, False, False)
    assert (tcfg.seed, cfg.seed) == (7, 3), "--train-seed and --seed are two settings"
    assert tcfg.compile and tcfg.fused_ce and tcfg.grad_checkpointing and cfg.trusted_network
    assert tcfg.metrics_port == -1 and cfg.doc_split == "line"
    assert (cfg.data, cfg.tokenizer) == (["x.txt", "y.txt"], "t.json")


def test_empty_variables_mean_none_as_compose_passes_them(env):
    env("LMPIPE_DATA", "")
    env("LMPIPE_TOKENIZER", "")
    env("LMPIPE_COMPILE", "0")
    ns = parse("train")
    assert from_args(ns, PipelineConfig) == PipelineConfig()
    assert from_args(ns, TrainConfig).compile is False


def test_a_list_variable_is_split_as_a_shell_would(env):
    env("LMPIPE_DATA", "'/data/my corpus.jsonl' \"b c.txt\" plain.txt")  # a path with a space, quoted
    assert from_args(parse("run"), PipelineConfig).data == ["/data/my corpus.jsonl", "b c.txt", "plain.txt"]


@pytest.mark.parametrize("before", [True, False])
def test_global_options_go_before_or_after_the_command(env, before):
    env("LMPIPE_LOG_LEVEL", "ERROR")
    argv = ["--log-level", "DEBUG", "run"] if before else ["run", "--log-level", "DEBUG"]
    assert from_args(parse(*argv), GlobalOptions).log_level == "DEBUG"
    assert from_args(parse("run"), GlobalOptions).log_level == "ERROR"


def test_pipeline_argv_reproduces_the_config_whatever_the_environment(env):
    for k, v in as_env(PipelineConfig(strategy="pad", seq_len=16)).items():
        env(k, v)  # a different config in the environment must not leak into the producers
    for cfg in (PIPELINE, PipelineConfig()):  # PipelineConfig(): tokenizer None travels as well
        assert from_args(parse("produce", *pipeline_argv(cfg)), PipelineConfig) == cfg
    opts = ProduceOptions(worker=1, metrics_port=-1, metrics_linger=2.5, exit_with_parent=True)
    assert from_args(parse("produce", *to_argv(opts)), ProduceOptions) == opts


def test_produce_help_leaves_out_how_many_producers_run_starts():
    """`lmpipe produce` takes the whole PipelineConfig (the argv round trip above), but --producers, which
    only `lmpipe run` reads, is not in its --help."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert "--producers" not in commands["produce"].format_help()
    assert "--producers" in commands["run"].format_help()
    assert from_args(parse("produce", "--producers", "3"), PipelineConfig).producers == 3


def test_an_empty_data_value_is_refused_not_read_as_the_built_in_corpus(env, capsys):
    """`--data "$CORPUS"` with CORPUS unset passed one empty value, which trained the built-in corpus
    silently; to_argv's empty list has a spelling of its own, and an empty variable still means none."""
    for argv in (["--data", ""], ["--data="], ["--data", "a.txt", ""]):
        with pytest.raises(SystemExit):
            parse("run", *argv)
        err = capsys.readouterr().err.strip()
        assert (
            err
            == "lmpipe run: --data: an empty value (an unset shell variable?); leave --data out to use its default (none)"
        )
    assert from_args(parse("produce", *pipeline_argv(PipelineConfig())), PipelineConfig).data == []
    env("LMPIPE_DATA", "")
    assert from_args(parse("run"), PipelineConfig).data == []


def test_validation_names_the_flag_or_the_variable(env):
    with pytest.raises(SettingsError, match=r"^--accum 0: must be >= 1$"):
        from_args(parse("run", "--accum", "0"), TrainConfig)
    env("LMPIPE_ACCUM", "0")
    with pytest.raises(SettingsError, match=r"^LMPIPE_ACCUM=0: must be >= 1$"):
        from_args(parse("run"), TrainConfig)


@pytest.mark.parametrize(
    "argv, cls, message",
    [
        (["--lr", "inf"], "train", "--lr inf: must be a finite number > 0"),  # it said "must be > 0"
        (["--lr", "0"], "train", "--lr 0.0: must be > 0"),
        (["--wait-timeout", "nan"], "train", "--wait-timeout nan: must be a number >= 0"),
        (["--curve-dir", "{file}"], "pipeline", "--curve-dir {file}: is not a directory"),
        (["--curve-dir", "{file}/nope"], "pipeline", "--curve-dir {file}/nope: no such directory"),
    ],
)
def test_a_number_or_folder_refused_says_what_it_is(argv, cls, message, tmp_path):
    file = tmp_path / "keys"
    file.write_text("")
    argv = [a.replace("{file}", str(file)) for a in argv]
    with pytest.raises(SettingsError) as e:
        from_args(parse("run", *argv), TrainConfig if cls == "train" else PipelineConfig)
    assert str(e.value) == message.replace("{file}", str(file))


def test_cross_checks_name_the_variable_that_gave_a_value(env):
    env("LMPIPE_PRECISION", "fp8")
    env("LMPIPE_DEVICE", "cpu")
    with pytest.raises(SettingsError, match=r"^LMPIPE_PRECISION=fp8 needs .*; LMPIPE_DEVICE=cpu is the CPU$"):
        from_args(parse("train"), TrainConfig)
    with pytest.raises(SettingsError, match=r"^LMPIPE_PRECISION=fp8 needs .*; --device cpu is the CPU$"):
        from_args(parse("train", "--device", "cpu"), TrainConfig)  # a flag wins, and is named
    env("LMPIPE_RANK", "3")
    with pytest.raises(SettingsError, match=r"^LMPIPE_RANK=3 must be below --world-size 1$"):
        from_args(parse("produce"), PipelineConfig)


def test_only_a_mention_of_the_value_the_environment_gave_names_the_variable(env):
    env("LMPIPE_DEVICE", "cuda")
    env("LMPIPE_COMPILE", "yes")
    env("LMPIPE_TF32", "off")
    env("LMPIPE_DATA", "a.txt 'my corpus.txt'")
    env("LMPIPE_LR", "0.5")
    env("LMPIPE_CHECKPOINT_DIR", r"C:\runs\1")
    env("LMPIPE_MAX_LINE_BYTES", "100000")
    ns = parse("run", "--accum", "2")
    for message, said in [
        ("--device cuda: no GPU here; use --device cpu", "LMPIPE_DEVICE=cuda: no GPU here; use --device cpu"),
        ("--device cuda:1 is not there", None),  # another value
        ("--compile needs a compiler (--no-compile)", "LMPIPE_COMPILE=on needs a compiler (--no-compile)"),
        ("--no-tf32 with --tf32", "LMPIPE_TF32=off with --tf32"),
        ("--data a.txt 'my corpus.txt' is empty", "LMPIPE_DATA=a.txt 'my corpus.txt' is empty"),
        ("--data: nothing there", "LMPIPE_DATA: nothing there"),
        # one path of the list: named as in the variable (a message about it said --data, never typed)
        (
            "--data a.txt is a shard set: give it as the only --data",
            "a.txt (in LMPIPE_DATA) is a shard set: give it as the only --data",
        ),
        ("--data 'my corpus.txt': no such file", "'my corpus.txt' (in LMPIPE_DATA): no such file"),
        ("--data my corpus.txt, a folder", "my corpus.txt (in LMPIPE_DATA), a folder"),
        ("--data b.txt is a shard set; --data a.txtx too", None),  # not one of its paths
        ("--lr 0.5, higher than 0.1", "LMPIPE_LR=0.5, higher than 0.1"),
        (r"--checkpoint-dir C:\runs\1: not writable", r"LMPIPE_CHECKPOINT_DIR=C:\runs\1: not writable"),
        ("a line exceeds --max-line-bytes 100,000", "a line exceeds LMPIPE_MAX_LINE_BYTES=100,000"),
        ("--accum 2 with --seq-len 128", None),  # a flag, and a default
        ("--compile-mode default; --lr 0.55; --device cudas", None),  # other flags, other values
    ]:
        assert name_sources(message, ns, (PipelineConfig, TrainConfig)) == (said or message)


def test_settings_said_together_are_named_each_by_its_source(env):
    """per_rank's "--rank/--world-size 1/3 disagree with torchrun's 0/2": said as one, each value from the
    environment is named as its variable; the message is left as it is unless the values are the run's."""
    env("LMPIPE_RANK", "1")
    env("LMPIPE_WORLD_SIZE", "3")
    both, one = parse("train"), parse("train", "--world-size", "3")
    said = "--rank/--world-size 1/3 disagree with torchrun's 0/2; leave them out under torchrun"
    assert name_sources(said, both, (PipelineConfig,)) == (
        "LMPIPE_RANK=1 and LMPIPE_WORLD_SIZE=3 disagree with torchrun's 0/2; leave them out under torchrun"
    )
    assert name_sources(said, one, (PipelineConfig,)).startswith("LMPIPE_RANK=1 and --world-size 3 disagree")
    assert name_sources(said, parse("train", "--rank", "1", "--world-size", "3"), (PipelineConfig,)) == said
    for other in ("--rank/--world-size 1/4 disagree", "--rank/--world-size 1/3/5 x", "--rank/--nope 1/3 x"):
        assert name_sources(other, both, (PipelineConfig,)) == other


def test_this_run_has_names_the_variable_that_gave_it(env, tmp_path):
    """lmpipe/launch.py's refusal of a checkpoint of another --doc-split states this run's as the setting:
    `this run has --doc-split line`, which names LMPIPE_DOC_SPLIT where that gave it (it said `this run has
    line`, which nothing could name)."""
    import json

    from lmpipe.launch import check_resume_corpus
    from lmpipe.producer.sources import Corpus

    env("LMPIPE_DOC_SPLIT", "line")
    data = tmp_path / "a.txt"
    data.write_text("one document\n")
    ck = tmp_path / "ck"
    ck.mkdir()
    had = Corpus([str(data)], doc_split="blank").fingerprint()
    (ck / "header.json").write_text(json.dumps({"format_version": 1, "data": had}))
    with pytest.raises(SettingsError) as info:
        check_resume_corpus(Corpus([str(data)], doc_split="line"), TrainConfig(resume=str(ck)))
    said = name_sources(str(info.value), parse("run"), (PipelineConfig, TrainConfig))
    assert said == (
        f"{ck} was trained with --doc-split blank, this run has LMPIPE_DOC_SPLIT=line: resume with the same "
        "--doc-split"
    )


def test_an_invalid_config_cannot_be_made():
    with pytest.raises(SettingsError, match=r"^--accum 0: must be >= 1$"):
        TrainConfig(accum=0)
    with pytest.raises(SettingsError, match=r"^--slots 1 is fewer than --accum 2"):
        TrainConfig(accum=2, slots=1)
    with pytest.raises(SettingsError, match=r"^--rank 1 must be below --world-size 1$"):
        PipelineConfig(rank=1)


def test_batch_spec_is_the_pipeline_configs_batching():
    names = [f.name for f in fields(BatchSpec)]
    assert BatchSpec() == BatchSpec(**{n: getattr(PipelineConfig(), n) for n in names}), "same defaults"
    assert BatchSpec.of(PIPELINE) == BatchSpec(**{n: getattr(PIPELINE, n) for n in names})
    with pytest.raises(ValueError, match="--seq-len 1: must be in 2..65535"):
        BatchSpec(seq_len=1)


def test_model_names_are_the_presets():
    from lmpipe.consumer.model import PRESETS

    assert tuple(PRESETS) == MODELS


def test_compose_variables_are_settings():
    import re

    known = {s.env for cls in (PipelineConfig, TrainConfig, ReportOptions, ProduceOptions, GlobalOptions)
             for s in specs(cls)}  # fmt: skip
    for f in ("docker-compose.yml", "docker-compose.cpu.yml"):
        used = set(re.findall(r"^\s+(LMPIPE_\w+):", (REPO / f).read_text(), re.M))
        assert used and used <= known, f"{f}: {sorted(used - known)} are no setting"
