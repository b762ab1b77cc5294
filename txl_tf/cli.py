"""The one way a command-line entry point defines its flags and runs.

Every entry point (`python -m txl_tf.train`, `txl_tf.evaluate`, ...) has the same shape:

    from txl_tf import cli

    def define_flags(flag_values) -> None:
        cli.define_model_flags(flag_values)  # shared flags come from here: same name, same type, same help
        flags.DEFINE_string("split", "test", "Split to evaluate.", flag_values=flag_values)

    def main(argv): ...

    if __name__ == "__main__":
        cli.run(main, define_flags)

Importing an entry point defines no flags, so several can be imported into one process (tests do); `run`
defines them on absl's global FLAGS just before parsing. Importing this module sets TF_CPP_MIN_LOG_LEVEL=2
(unless already set), which hides TensorFlow's C++ INFO and WARNING lines when this module is imported before
TensorFlow, as the entry points do.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from txl_tf import errors
from txl_tf.errors import ConfigError

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

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
    --gin_param (read by `txl_tf.loading.load_model_from_flags`)."""
    define(flag_values, *MODEL_FLAGS)


def no_arguments(argv: list, hint: str = "see --helpshort") -> None:
    """Raises ConfigError when the command line holds positional arguments (argv[0] is the program)."""
    if len(argv) > 1:
        raise ConfigError(f"unexpected arguments {argv[1:]}; {hint}")


def run(main: Callable[[list], object], define_flags: Callable[[object], None], *,
        verbosity: str = "warning") -> None:
    """Defines the entry point's flags on absl's FLAGS, parses the command line and runs `main(argv)`.

    Expected errors (txl_tf.errors.UserError, bad flags) print one `error:` line and exit with status 2
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
        return main(argv)

    errors.run(main_at_verbosity)
