"""`jax_epilog.config`: every setting parsed in one place and listed in the README."""

import re
from pathlib import Path

import pytest

from jax_epilog import config

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_lists_every_setting_with_its_default():
    text = README.read_text()
    documented = dict(re.findall(r"^\| `(JAX_EPILOG_\w+)` \| ([^|]+) \|", text, re.M))
    for setting in config.SETTINGS:
        assert setting.variable in documented, f"{setting.variable} is not in the README table"
        assert setting.default.strip("`") in documented[setting.variable]
    assert set(documented) == {s.variable for s in config.SETTINGS}


def test_only_settings_reads_the_environment():
    package = Path(config.__file__).parent
    readers = [p.name for p in package.glob("*.py")
               if p.name != "settings.py" and re.search(r"os\.environ|getenv", p.read_text())]
    assert readers == []
    ffi = package.parent / "ffi"
    if ffi.is_dir():  # a source checkout
        assert [p.name for p in ffi.glob("*.cc") if "getenv" in p.read_text()] == []


@pytest.mark.parametrize("value,expected", [(None, None), ("auto", None), ("cublaslt", "cublaslt"),
                                            ("XLA", "xla"), (" xla ", "xla")])
def test_backend_override(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    else:
        monkeypatch.setenv("JAX_EPILOG_BACKEND", value)
    assert config.backend_override() == expected


def test_bad_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("JAX_EPILOG_BACKEND", "cudnn")
    with pytest.raises(ValueError, match="^JAX_EPILOG_BACKEND='cudnn': expected one of"):
        config.backend_override()
    monkeypatch.setenv("JAX_EPILOG_PLAN_CACHE_SIZE", "0")
    with pytest.raises(ValueError, match="^JAX_EPILOG_PLAN_CACHE_SIZE='0': expected an integer"):
        config.plan_cache_capacity()
    monkeypatch.setenv("JAX_EPILOG_WORKSPACE_BYTES", "lots")
    with pytest.raises(ValueError, match="^JAX_EPILOG_WORKSPACE_BYTES='lots'"):
        config.workspace_bytes()


def test_defaults(monkeypatch, tmp_path):
    for setting in config.SETTINGS:
        monkeypatch.delenv(setting.variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert config.autotune() is True and config.pad_unaligned() is True
    assert config.autotune_log() is False and config.cuda_disabled() is False
    assert config.workspace_bytes() == 32 * 1024 * 1024
    assert config.plan_cache_capacity() == 4096
    assert config.decisions_path() == tmp_path / ".cache" / "jax_epilog" / "decisions.json"
    monkeypatch.setenv("JAX_EPILOG_DECISIONS", "")
    assert config.decisions_path() is None


def test_setters_check_their_argument():
    with pytest.raises(TypeError, match="^enabled: expected a bool"):
        config.set_autotune(1)
    with pytest.raises(ValueError, match="^plans: expected an int >= 1"):
        config.set_plan_cache_capacity(0)
