"""Builds zen_mla/attention/kernels/native.cpp (with its headers, one per ISA path) into
`zen_mla.attention.kernels._native`, a torch C++ extension whose import registers the operator
`torch.ops.zen_mla.native_attend`; everything else about the project is in pyproject.toml.

The native kernel is optional: a build that cannot or may not happen does not fail the install.
It leaves `_native_unbuilt.txt` where the module would be, one line saying why (no compiler, the
compile failed, torch missing at build time, `ZEN_MLA_NATIVE=0`); a build that succeeds removes
that file and a failed one removes the module an earlier build left there, so the two never
disagree. An editable install (`pip install -e .`) puts both in the source tree."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
import tempfile
import warnings

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NAME = "zen_mla.attention.kernels._native"
SOURCE = "zen_mla/attention/kernels/native.cpp"
#: what native.cpp includes: a change to one rebuilds it
HEADERS = [f"zen_mla/attention/kernels/native_{name}.h" for name in ("plan", "avx512", "avx2")]
REASON_FILE = "_native_unbuilt.txt"
FLAGS = ["-O3", "-fopenmp"]  # no -march: each path's functions name their ISA; loads anywhere

# scripts/bootstrap builds before pip installs numpy; torch says so on import, harmlessly
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension, get_cxx_compiler
except Exception:  # torch is not installed (or does not import): no build, and say so
    BuildExtension = build_ext
    EXTENSION = Extension(NAME, [SOURCE], depends=HEADERS, optional=True)
    NO_TORCH = "torch was not installed when zen-mla was built"
else:
    EXTENSION = CppExtension(
        NAME, [SOURCE], depends=HEADERS, extra_compile_args=FLAGS, optional=True
    )
    NO_TORCH = ""


def _error_line(output: str, error: BaseException) -> str:
    """The compiler's first error, else the last non-empty line the failure printed or said."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if re.search(r"\berror\b", line, re.I) and not line.startswith(("FAILED:", "ninja:")):
            return line
    said = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (said or lines or [type(error).__name__])[-1]


def _remove(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)


class BuildNative(BuildExtension):  # type: ignore[misc, valid-type]
    """torch's BuildExtension, made optional: any failure becomes a reason file, not an error
    (`Extension(optional=True)` alone lets ninja's RuntimeError through)."""

    def build_extensions(self) -> None:
        try:
            super().build_extensions()  # torch checks the compiler's ABI here, before building
        except Exception as error:
            for ext in self.extensions:
                self._unbuilt(ext, f"the C++ build failed: {_error_line('', error)}")

    def build_extension(self, ext: Extension) -> None:
        reason = self._why_not(ext)
        if reason:
            self._unbuilt(ext, reason)
            return
        try:
            self._build_capturing_output(ext)
        except Exception as error:
            self._unbuilt(ext, f"the C++ build failed: {_error_line(self._output, error)}")
            return
        _remove(os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), REASON_FILE))

    def _why_not(self, ext: Extension) -> str:
        if os.environ.get("ZEN_MLA_NATIVE", "").strip() == "0":
            return "built with ZEN_MLA_NATIVE=0"
        if NO_TORCH:
            return NO_TORCH
        compilers = {get_cxx_compiler(), *getattr(self.compiler, "compiler_cxx", [])[:1]}
        missing = sorted(c for c in compilers if not shutil.which(shlex.split(c)[0]))
        if missing:
            return f"no C++ compiler ({'/'.join(missing)}) on the build host"
        return ""

    def _build_capturing_output(self, ext: Extension) -> None:
        """Builds with the compiler's output (ninja writes to fd 1) copied aside, to name the
        error if there is one, and passed on as it would have been."""
        self._output = ""
        with tempfile.TemporaryFile() as log:
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                super().build_extension(ext)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
                log.seek(0)
                data = log.read()
                os.write(1, data)
                self._output = data.decode(errors="replace")

    def _unbuilt(self, ext: Extension, reason: str) -> None:
        """Writes the reason where the module would be and removes a module left there."""
        print(f"zen-mla: {NAME} not built: {reason}", file=sys.stderr)
        path = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _remove(path)
        with open(os.path.join(os.path.dirname(path), REASON_FILE), "w") as out:
            out.write(reason + "\n")

    def copy_extensions_to_source(self) -> None:
        """Editable and in-place builds: the module or the reason file, never both, in the
        source tree (setuptools copies only the module, and only when it was built)."""
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace, regular = self._get_inplace_equivalent(build_py, ext)
            built_reason = os.path.join(os.path.dirname(regular), REASON_FILE)
            inplace_reason = os.path.join(os.path.dirname(inplace), REASON_FILE)
            if os.path.exists(built_reason):
                _remove(inplace)
                self.copy_file(built_reason, inplace_reason, level=self.verbose)
            else:
                _remove(inplace_reason)


setup(ext_modules=[EXTENSION], cmdclass={"build_ext": BuildNative})
