"""Settings: each dataclass field is the one definition of its flag, variable, default and check."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO, lmpipe_env


def test_help_version_and_parsing_import_no_torch():
    code = (
        "import contextlib, io, sys\n"
        "from lmpipe.cli import build_parser, main\n"
        "import lmpipe.launch, lmpipe.producer.manager\n"
        "for argv in (['--help'], ['run', '--help'], ['--version']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(argv)\n"
        "build_parser().parse_args(['produce'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=lmpipe_env(), cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    version = subprocess.run(
        [sys.executable, "-m", "lmpipe", "--version"], env=lmpipe_env(), capture_output=True, text=True
    )
    from lmpipe import __version__

    assert version.stdout.strip() == f"lmpipe {__version__}" and version.returncode == 0
