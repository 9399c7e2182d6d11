"""What a GPU machine with its own JAX but no package registry needs to run diffjax: the list `make gpu-wheels`
downloads (`pip download --no-deps`) into one folder (docs/compile.md, "On the accelerator").

    python -m diffjax.bench.gpu_wheels --pyproject pyproject.toml --also tokenizers --python 3.12 --jax 0.11.2

prints `name==version`, one a line: diffjax's dependencies and the `--also` packages with all they need in turn (markers
evaluated for that Python on this host's OS), at the versions installed here, less JAX and all it brings: the machine
has those, and pip must not replace them. Exit status 2, one line, when a package is not installed here or a pin on
jax or jaxlib excludes the machine's `--jax` (`pip install --no-index` would try to replace it, and fail).
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import platform
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

JAX_OWN = ("jax", "jaxlib")  # whose pins must admit the machine's jax version


class Unmet(Exception):
    """A package that is not installed here, or a pin that excludes the machine's jax: one line, exit status 2."""


def marker_environment(python: str) -> dict[str, str]:
    """Environment markers of the target Python (`3.12`) on this host's OS and machine."""
    return {"python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "sys_platform": sys.platform, "os_name": "posix",
            "platform_system": platform.system(), "platform_machine": platform.machine(), "extra": ""}


def closure(roots: list[Requirement], env: dict[str, str], provided=frozenset()
            ) -> tuple[dict[str, str], list[tuple[str, Requirement]]]:
    """({canonical name: installed version} of `roots` and all they require, [(requirer, requirement)] met on the
    way), each package followed once per extra asked of it; the `provided` are neither listed nor followed."""
    versions, followed, seen = {}, [], set()
    stack = [(None, r) for r in roots if r.marker is None or r.marker.evaluate(env)]
    while stack:
        requirer, req = stack.pop()
        name = canonicalize_name(req.name)
        followed.append((requirer, req))
        if name in provided:
            continue
        for extra in ("", *sorted(req.extras)):
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            try:
                versions[name] = metadata.version(name)
                own = [Requirement(r) for r in metadata.requires(name) or []]
            except metadata.PackageNotFoundError:
                raise Unmet(f"{name} (required by {requirer or 'the list'}) is not installed in this environment "
                            f"({sys.prefix}); install it there first") from None
            # an extra's requirements are the ones whose marker holds with `extra` set (etils[epath] → fsspec, ...)
            stack += [(name, r) for r in own
                      if r.marker is None or r.marker.evaluate(env | {"extra": extra})]
    return versions, followed


def wheel_list(pyproject: Path, also: list[str], python: str, jax_version: str, leave_out: list[str] = ()
               ) -> list[str]:
    """`name==version` of what the GPU machine lacks (module doc), sorted, less `leave_out` and what only it needs."""
    project = tomllib.loads(pyproject.read_text())["project"]
    roots = [Requirement(r) for r in [*project["dependencies"], *also]]
    env = marker_environment(python)
    jax_brings, _ = closure([Requirement("jax")], env)
    provided = frozenset(jax_brings) | {canonicalize_name(name) for name in leave_out}
    versions, followed = closure(roots, env, provided=provided)
    for requirer, req in followed:
        if canonicalize_name(req.name) in JAX_OWN and not req.specifier.contains(Version(jax_version),
                                                                                prereleases=True):
            raise Unmet(f"{requirer or project['name']} requires {req}, which the GPU machine's jax {jax_version} "
                        f"does not satisfy: pip would try to replace that jax")
    return sorted(f"{name}=={version}" for name, version in versions.items())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"), help="diffjax's pyproject.toml")
    parser.add_argument("--also", nargs="*", default=[], help="further packages to ship (e.g. tokenizers)")
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python, major.minor")
    parser.add_argument("--jax", required=True, help="the GPU machine's jax version (e.g. 0.11.2)")
    parser.add_argument("--leave-out", nargs="*", default=[],
                        help="packages the run there never imports (e.g. matplotlib: the device check draws nothing)")
    args = parser.parse_args(argv)
    try:
        lines = wheel_list(args.pyproject, args.also, args.python, args.jax, args.leave_out)
    except (Unmet, OSError) as err:
        print(f"gpu_wheels: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
