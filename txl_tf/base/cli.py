"""The one way a command-line entry point defines its flags and runs.

Every entry point (`python -m txl_tf.train`, `txl_tf.evaluate`, ...) has the same shape:

    from txl_tf.base import cli

    def define_flags(flag_values) -> None:
        cli.define_model_flags(flag_values)  # shared flags come from here: same name, same type, same help
        flags.DEFINE_string("split", "test", "Split to evaluate.", flag_values=flag_values)

    def main(argv): ...

    if __name__ == "__main__":
        cli.run(main, define_flags)

Importing an entry point defines no flags, so several can be imported into one process (tests do); `run`
defines them on absl's global FLAGS just before parsing.

TensorFlow's start-up lines are quiet: importing this module before TensorFlow (as every entry point does)
sets TF_CPP_MIN_LOG_LEVEL=3 unless it is set (TensorFlow's C++ log keeps FATAL lines only; errors reach the
user as Python exceptions) and sets aside what TensorFlow prints while it is imported (the absl pre-init
warning, the oneDNN and CUDA-driver notices), which is shown only when that import fails. With
TXL_TF_TF_LOGS=1 in the environment TensorFlow logs as it would without txl_tf.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable

from txl_tf.base import errors
from txl_tf.base.errors import ConfigError

# The tf.distribute strategies of --strategy (txl_tf.training.distribute.make_strategy makes them).
STRATEGIES = ("default", "one_device", "mirrored", "multi_worker_mirrored", "tpu")

TF_LOGS_ENV = "TXL_TF_TF_LOGS"


@contextlib.contextmanager
def _stderr_set_aside():
    """Sends the process's stderr (file descriptor 2, C++ included) to a temporary file for the block; what it
    caught is written back only when the block raises."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to set aside
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if failed:
                caught.seek(0)
                os.write(2, caught.read())


class _QuietLoader(importlib.abc.Loader):
    """Runs the real loader of `tensorflow` with stderr set aside, then gives the module its real loader back."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader
        with _stderr_set_aside():
            self.loader.exec_module(module)


class _QuietTensorFlowImport(importlib.abc.MetaPathFinder):
    """Finds `tensorflow` for its first import (then leaves sys.meta_path) and makes that import quiet."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "tensorflow":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _QuietLoader(spec.loader)
        return spec


def quiet_tensorflow() -> None:
    """Hides TensorFlow's start-up lines (see the module's docstring) unless $TXL_TF_TF_LOGS is 1; acts before
    TensorFlow's import only."""
    value = os.environ.get(TF_LOGS_ENV, "").strip().lower()
    if value in ("1", "true", "yes"):
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if "tensorflow" not in sys.modules and not any(isinstance(f, _QuietTensorFlowImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietTensorFlowImport())


quiet_tensorflow()

# The flags several entry points share: name -> (absl DEFINE function name, default, help, extra arguments).
# Commands that read a run define them through `define` (or the groups below), never themselves.
SHARED = {
    "model_dir": ("DEFINE_string", None, "Run directory: config.gin, checkpoints and TensorBoard logs.", {}),
    "checkpoint": ("DEFINE_string", None, "Checkpoint prefix, or a directory of checkpoints (its newest is "
                   "read).", {}),
    "which": ("DEFINE_enum", "latest", "Checkpoint of a --model_dir: the latest or best/.",
              {"enum_values": ["latest", "best"]}),
    "gin_file": ("DEFINE_multi_string", [], "Gin files, applied in order (after MODEL_DIR/config.gin where the "
                 "command reads a run), e.g. gin/sample.gin.", {}),
    "gin_param": ("DEFINE_multi_string", [], "Gin bindings applied after the files, e.g. "
                  "EvalConfig.mem_len=800.", {}),
}
MODEL_FLAGS = ("model_dir", "checkpoint", "which", "gin_file", "gin_param")

# The flags of any entry point that name a path: given on the command line, each must be a non-empty path
# (`txl_tf.base.paths.given`; an empty one would mean the working directory). What a command writes is checked
# further by the command (`paths.output_dir`, `paths.replaceable_dir`, `paths.output_file`).
PATH_FLAGS = ("model_dir", "checkpoint", "gin_file", "data_dir", "export_dir", "output_dir", "source",
              "vocab_source", "cache_dir", "vocab_from", "from_original_cache", "token_losses", "markdown", "json",
              "output", "logdir", "saved_model", "data_root", "publish", "readme", "peer", "checkpoints")


def define(flag_values, *names: str) -> None:
    """Defines the shared flags `names` (keys of SHARED) on `flag_values`."""
    from absl import flags

    for name in names:
        definer, default, help_text, extra = SHARED[name]
        if definer == "DEFINE_enum":
            flags.DEFINE_enum(name, default, extra["enum_values"], help_text, flag_values=flag_values)
        else:
            getattr(flags, definer)(name, default, help_text, flag_values=flag_values)


def define_model_flags(flag_values) -> None:
    """The flags of a command that loads a trained model: --model_dir, --checkpoint, --which, --gin_file,
    --gin_param (read by `txl_tf.runs.loading.load_model_from_flags`)."""
    define(flag_values, *MODEL_FLAGS)


def no_arguments(argv: list, hint: str = "see --helpshort") -> None:
    """Raises ConfigError when the command line holds positional arguments (argv[0] is the program)."""
    if len(argv) > 1:
        raise ConfigError(f"unexpected arguments {argv[1:]}; {hint}")


def check_path_flags(flag_values) -> None:
    """Refuses (one line) an empty value of a path flag given on the command line (`PATH_FLAGS`)."""
    from txl_tf.base import paths

    for name in PATH_FLAGS:
        if name in flag_values and flag_values[name].present:
            value = flag_values[name].value
            for item in value if isinstance(value, list) else [value]:
                paths.given(item, f"--{name}")


def run(main: Callable[[list], object], define_flags: Callable[[object], None], *,
        verbosity: str = "warning") -> None:
    """Defines the entry point's flags on absl's FLAGS, parses the command line and runs `main(argv)`.

    Expected errors (txl_tf.base.errors.UserError, bad flags) print one `error:` line and exit with status 2
    (`errors.run`). absl's log verbosity is `verbosity` ("debug", "info", "warning", "error") unless
    --verbosity is given: gin's and TensorFlow's INFO lines would drown the commands' own output.
    """
    from absl import flags
    from absl import logging as absl_logging

    define_flags(flags.FLAGS)
    for flag in flags.FLAGS.get_flags_for_module(__name__):  # the shared flags show in the command's --help
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)

    def main_at_verbosity(argv):
        if not flags.FLAGS["verbosity"].present:
            absl_logging.set_verbosity(verbosity)
        check_path_flags(flags.FLAGS)
        return main(argv)

    errors.run(main_at_verbosity)
