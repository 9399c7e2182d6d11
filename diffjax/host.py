"""On a host without accelerator devices, JAX is told to use the CPU: probing the TPU and CUDA plugins that the
compile extra installs would only print errors before every command and in every notebook's output."""

from __future__ import annotations

import contextlib
import glob
import importlib.abc
import importlib.machinery
import os
import sys

NVIDIA_DEVICES = "/dev/nvidia[0-9]*"  # one device node per GPU


def accelerator_attached() -> bool:
    """A GPU (/dev/nvidia0…) or TPU (/dev/accel0…, /dev/vfio/0…) device node on this host."""
    return any(glob.glob(pattern) for pattern in (NVIDIA_DEVICES, "/dev/accel[0-9]*", "/dev/vfio/[0-9]*"))


def cpu_unless_accelerator(*, start: bool = True) -> None:
    """Select JAX's CPU platform where no accelerator is attached (JAX_PLATFORMS, when set, decides), the plugins'
    lines silenced. `start=False` leaves the backends unstarted (a multi-process launch initializes
    jax.distributed first); where jax was imported before diffjax, the plugin's last line then prints."""
    if accelerator_attached():
        return
    with stderr_silenced():
        import jax

        if "JAX_PLATFORMS" not in os.environ:
            jax.config.update("jax_platforms", "cpu")
        if start:
            jax.devices()  # the backends start here, the plugin's last line with them


def run_script(main) -> None:
    """An experiments/ script: `cpu_unless_accelerator`, then `sys.exit(main())`; a ConfigError or DataError is one
    line on stderr, exit status 2."""
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
    """JAX on the CPU alone, whatever is attached (`diffjax compile`), the plugins' start-up lines silenced."""
    with stderr_silenced():
        import jax

        jax.config.update("jax_platforms", "cpu")
        jax.devices()


@contextlib.contextmanager
def stderr_silenced():
    """File descriptor 2 to /dev/null for the block: plugins log from C++, past Python's logging (the CUDA plugin's
    "Could not find cuda drivers"). A Python exception still prints, after the block."""
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
    """Imports jax, when something first does, as `cpu_unless_accelerator` would, its plugins at once (installed by
    `diffjax/__init__.py`, so that `diffjax --help` still imports no jax).

    A hook, because no setting reaches these lines (measured with jax 0.10.2 and the CUDA plugin, no GPU): `import
    jax` loads jaxlib.gpu_solver, gpu_sparse and gpu_prng, and each of the CUDA plugin's libraries they load
    (jax_cuda12_plugin/_solver.so, …) logs "Could not find cuda drivers on your machine" (cudart_stub.cc, absl INFO)
    from a static initializer, before absl::InitializeLog: straight to file descriptor 2, whatever
    TF_CPP_MIN_LOG_LEVEL or JAX_PLATFORMS say, before any jax.config option exists. Starting the backends loads
    xla_cuda_plugin.so, which prints it once more. (jax 0.12 imports quietly; JAX_PLATFORMS=cpu then suffices.)"""

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
                # (jax._src: no public API loads them without starting the backends)
                discover = getattr(sys.modules.get("jax._src.xla_bridge"), "_discover_and_register_pjrt_plugins", None)
                if discover:
                    discover()

        spec.loader.exec_module = quiet_exec_module
        return spec
