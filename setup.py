"""The one thing pyproject.toml cannot say: zfunc-as-deepspeed.pth goes into site-packages itself
(not into a package), for normal and editable installs alike. It runs at every interpreter start
and does nothing unless ZFUNC_AS_DEEPSPEED is set (startup/__init__.py says what it does then)."""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "zfunc-as-deepspeed.pth"


class build_py_with_pth(build_py):
    """build_py, plus the .pth at the top of the build folder: a wheel's top is site-packages."""

    def run(self):
        super().run()
        self.copy_file(os.path.join("startup", PTH), os.path.join(self.build_lib, PTH), preserve_mode=False)
        if getattr(self, "editable_mode", False):
            # an editable wheel holds the packages' finder, not build_lib: setuptools' editable_wheel
            # points install_lib at the folder it packs into that wheel, so the hook goes there
            top = self.get_finalized_command("install").install_lib
            self.copy_file(os.path.join("startup", PTH), os.path.join(top, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": build_py_with_pth})
