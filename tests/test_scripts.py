"""scripts/serve as a user meets it: installs on the first run, and again when pyproject.toml changed
since .venv was installed (after a pull that changes the dependencies), saying so; otherwise it
starts the gateway at once. Run in a copy with stand-ins for bootstrap and the gateway."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _checkout(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "serve", tmp_path / "scripts" / "serve")
    bootstrap = tmp_path / "scripts" / "bootstrap"
    bootstrap.write_text(  # what the real one leaves: the command, and the pyproject it installed from
        "#!/usr/bin/env bash\necho bootstrap >> calls\nmkdir -p .venv/bin\n"
        "printf '#!/bin/sh\\necho serving \"$@\"\\n' > .venv/bin/gateway\nchmod +x .venv/bin/gateway\n"
        "cp pyproject.toml .venv/.installed-pyproject.toml\n"
    )
    bootstrap.chmod(0o755)
    (tmp_path / "pyproject.toml").write_text('dependencies = ["fastapi"]\n')
    return tmp_path


def _serve(checkout: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(checkout / "scripts" / "serve"), "--port", "9000"], capture_output=True, text=True, timeout=30
    )


def test_serve_installs_first_then_only_when_the_dependencies_change(tmp_path: Path) -> None:
    checkout = _checkout(tmp_path)
    first = _serve(checkout)
    assert first.stdout.strip() == "serving serve --port 9000"
    assert "first run: installing" in first.stderr
    again = _serve(checkout)
    assert again.stderr == ""
    assert (checkout / "calls").read_text().count("bootstrap") == 1
    (checkout / "pyproject.toml").write_text('dependencies = ["fastapi", "a-new-one"]\n')  # a pull
    pulled = _serve(checkout)
    assert "pyproject.toml changed since .venv was installed" in pulled.stderr
    assert pulled.stdout.strip() == "serving serve --port 9000"
    assert (checkout / "calls").read_text().count("bootstrap") == 2
    assert _serve(checkout).stderr == ""
