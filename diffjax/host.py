"""What this host has: on a machine without accelerator devices, JAX is told to use the CPU.

The compile extra installs TPU and CUDA plugins; on a host without their devices, probing them only prints errors
(a traceback from the CUDA plugin, libtpu's warnings) before every command and in every notebook's output.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.abc
import importlib.machinery
import os
import sys


def accelerator_attached() -> bool:
    """A GPU (/dev/nvidia0…) or TPU (/dev/accel0…, /dev/vfio/0…) device node on this host."""
    return any(glob.glob(pattern) for pattern in ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*"))


def cpu_unless_accelerator(*, start: bool = True) -> None:
    """Select JAX's CPU platform where no accelerator is attached (JAX_PLATFORMS, when set, decides). The CUDA
    plugin's C++ logging ("Could not find cuda drivers", four times) is written to the process's stderr while jax
    loads its plugins, past any Python logging setting, so that file descriptor is closed to it meanwhile.
    `start=False` leaves the backends unstarted (a multi-process launch must call jax.distributed.initialize
    first); where jax was imported before diffjax (no `QuietJaxImport`), the plugin's last line then prints when
    they start."""
    if accelerator_attached():
        return
    with stderr_silenced():
        import jax

        if "JAX_PLATFORMS" not in os.environ:
            jax.config.update("jax_platforms", "cpu")
        if start:
            jax.devices()  # the backends start here, the plugin's last line with them


def run_script(main) -> None:
    """An experiments/ script's start: JAX on the CPU where no accelerator is (`cpu_unless_accelerator`), then
    `main() -> exit status`; bad input (a ConfigError or DataError) is one line on stderr, exit status 2 (not a
    traceback)."""
    from diffjax.config import ConfigError
    from diffjax.data.sources import DataError

    cpu_unless_accelerator()
    try:
        code = main()
    except (ConfigError, DataError) as e:
        print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)


def cpu_only() -> None:
    """JAX on the CPU alone, whatever is attached (`diffjax compile`: targets are reached through their topologies),
    the plugins' start-up lines silenced as in `cpu_unless_accelerator`."""
    with stderr_silenced():
        import jax

        jax.config.update("jax_platforms", "cpu")
        jax.devices()


@contextlib.contextmanager
def stderr_silenced():
    """File descriptor 2 to /dev/null for the block, where plugins log from C++ past Python's logging (the CUDA
    plugin's "Could not find cuda drivers", libtpu's errors about TPU hosts this is not). A Python exception
    still reaches the terminal: it is printed after the block, when the descriptor is back."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class QuietJaxImport(importlib.abc.MetaPathFinder):
    """Imports jax, when something first does, where no accelerator is attached: the CPU platform (unless
    JAX_PLATFORMS says otherwise) and the plugins' lines silenced (jax imports its plugins when the backends first
    start: here, at once). `diffjax/__init__.py` installs it, so scripts and notebooks that import diffjax stay
    quiet, and `diffjax --help` still imports no jax."""

    def find_spec(self, name, path=None, target=None):
        if name != "jax":
            return None
        sys.meta_path.remove(self)  # once: the finders after this one find jax itself
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def quiet_exec_module(module):
            if accelerator_attached():  # the plugins' messages may matter here
                exec_module(module)
                return
            with stderr_silenced():
                exec_module(module)
                if "JAX_PLATFORMS" not in os.environ:
                    module.config.update("jax_platforms", "cpu")
                # the plugins are imported when the backends first start, each printing again: import them now
                discover = getattr(sys.modules.get("jax._src.xla_bridge"), "_discover_and_register_pjrt_plugins", None)
                if discover:
                    discover()

        spec.loader.exec_module = quiet_exec_module
        return spec
