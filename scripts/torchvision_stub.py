"""Installs a stand-in `torchvision` into the current interpreter's site-packages.

PyPI's torchvision wheels are CUDA builds that fail against the CPU torch used here, and
sglang 0.5.23 imports torchvision only on multimodal paths this project never runs
(configs -> internvl_utils). The stand-in answers every `torchvision.*` import with a
MagicMock module, and its dist-info reports version 0.0.0 so transformers treats it as too
old for its fast image processors instead of failing on an unparsable version.

Usage: python scripts/torchvision_stub.py install
"""

import pathlib
import sys
import sysconfig

PACKAGE_INIT = '''"""Stand-in torchvision for CPU test environments (see scripts/torchvision_stub.py)."""
import importlib.abc
import importlib.machinery
import sys
from unittest.mock import MagicMock

__version__ = "0.0.0"


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = MagicMock(name=spec.name)
        module.__spec__ = spec
        module.__path__ = []
        module.__name__ = spec.name
        return module

    def exec_module(self, module):
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


sys.meta_path.insert(0, _StubFinder())


def __getattr__(name):
    return MagicMock(name=f"torchvision.{name}")
'''

METADATA = "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.0.0\n"


def install() -> None:
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    package = site / "torchvision"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text(PACKAGE_INIT)
    dist_info = site / "torchvision-0.0.0.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(METADATA)
    (dist_info / "RECORD").write_text("")
    print(f"torchvision stand-in installed in {site}")


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python scripts/torchvision_stub.py install")
    install()
