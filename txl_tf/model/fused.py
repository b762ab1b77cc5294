"""Fused CPU kernels for training steps: the attention's score chain and head layout, dropout, the residual
LayerNorm and the feed-forward activation, one pass each way.

`txl_tf/model/kernels/fused_ops.cc` holds TensorFlow custom ops: `TxlRelSoftmax` / `TxlRelSoftmaxGrad` (relative
shift, add, mask and softmax of the attention scores, and its gradient), `TxlDropout` (draw, compare and scale
in one pass; the backward pass draws the same mask again), `TxlAddLayerNorm` / `TxlAddLayerNormGrad` (the
post-norm residual, LayerNorm(x + residual), in float32), `TxlBiasReluDropout` / `TxlBiasReluDropoutGrad` (the
feed-forward layer's bias, ReLU and dropout after its first matmul) and `TxlSplitHeads` / `TxlMergeHeads` (the
attention's projections to and from the heads-first layout, each the other's gradient). This module compiles the
file on first use with the C++ compiler and TensorFlow's own flags (`tf.sysconfig`), caches the shared library per
source, TensorFlow version, compiler and CPU, loads it with `tf.load_op_library`, and registers the gradients.

Whether a model uses them is a configuration choice, never read from the environment: `TrainConfig.kernels`
("tf": TensorFlow's ops, the default; "fused": these kernels) is resolved once by the trainer (`unavailable` says
why a process cannot use them: no compiler, a failed build or load), which passes a `TrainingPolicy` with
`kernels=True` (`txl_tf.model.policy`) to its training calls only for "fused". The layers (`txl_tf.model.dropout.Dropout`,
`RelativeMultiHeadAttention`, `PositionwiseFeedForward`, ...) then use the kernels in training calls of float32 or
bfloat16 (`applies`); the kernels are not part of a model's architecture or config; inference
and export keep TensorFlow's ops, so SavedModels never depend on the library. XLA cannot run custom ops, so
`kernels="fused"` with `jit_compile=True` is a configuration error. The kernels' dropout draws its masks from
another Philox stream than TensorFlow's ops (same drop probability), so one seed gives two different runs on the
two paths: a run records the path it trained with in its config.gin (`txl_tf.train`).

Environment (where the kernels are built, not whether they are used):
  TXL_TF_CACHE          the cache the data downloads use too (default `~/.cache/txl_tf`); compiled libraries
                        go to its `kernels/` folder (to the temporary directory when that cannot be created).
                        A cached library is loaded only when it and its folders belong to this user and no one
                        else may write them, nor any folder above them up to the root (`untrusted_path`: each
                        of them this user's or root's; a sticky shared folder like /tmp only above one that
                        passed); otherwise the kernels are built afresh in a private temporary folder for the
                        process, with one warning. What is loaded is exactly the file checked: it is opened
                        without following a link, checked through its descriptor (a regular file of this user
                        that no one else may write) and copied through that descriptor into a fresh private
                        folder (`tempfile.mkdtemp`, mode 0700), and that copy is loaded and then removed; so a
                        folder swapped between the check and the load is never loaded from.
  CXX                   the compiler (default: the first of g++, c++, clang++ on PATH).
"""

from __future__ import annotations

import atexit
import errno
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import stat
import subprocess
import tempfile
import threading

import tensorflow as tf

from txl_tf.base.untrusted import make_private_dirs, owner_problem, untrusted_path
from txl_tf.model.policy import KERNELS  # the choices of TrainConfig.kernels

SOURCE = pathlib.Path(__file__).resolve().parent / "kernels" / "fused_ops.cc"
_BASE_FLAGS = ["-shared", "-fPIC", "-O3", "-fno-math-errno", "-Wno-deprecated-declarations"]
_LIBRARY_LIMIT = 256 << 20  # the library is ~1 MiB; more is not one this module built


def cache_dir():
    """Where compiled kernels are kept (created on demand): `kernels/` of $TXL_TF_CACHE, else of ~/.cache/txl_tf
    (the data downloads' cache, `txl_tf.data.sources`)."""
    base = os.environ.get("TXL_TF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "txl_tf")
    return pathlib.Path(base) / "kernels"


def _compiler():
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"]) or os.environ["CXX"]
    for name in ("g++", "c++", "clang++"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature():
    """What -march=native compiles for: the CPU's model and feature flags (a library built on one CPU may use
    instructions another lacks, so each CPU gets its own build)."""
    parts = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    parts.append(line.strip())
                if len(parts) >= 5:
                    break
    except OSError:
        pass
    return "\n".join(parts)


class _Untrusted(Exception):
    """The library file opened for loading may hold code this user did not build (the message says why)."""


def _untrusted_path(root, target):
    """Why the library `target` (root/<key>/fused_ops.so) may not be this user's, or None: what `untrusted_path`
    says of the library (of its folder when it is not built yet) and of every folder above it."""
    try:
        return untrusted_path(target)
    except FileNotFoundError:  # not built yet: it is built here
        return untrusted_path(target.parent)


def _private_dirs(*paths):
    """Creates each missing folder of `paths` (and above them) readable and writable by this user only."""
    for path in paths:
        make_private_dirs(path)


def _cache_key(compiler):
    """The library's folder name: a hash of the source, TensorFlow's version, the compiler, the flags and the CPU."""
    return hashlib.sha256(
        "\0".join([SOURCE.read_text(), tf.__version__, compiler, " ".join(_BASE_FLAGS), _cpu_signature()]).encode()
    ).hexdigest()[:16]


def _library_path(key):
    """Where the library of `key` is built and loaded from (built first when missing): `cache_dir()/key/
    fused_ops.so`, else `txl_tf-kernels-UID/key/` in the temporary directory when the cache cannot be created.
    When the folder found may hold another user's library (a predictable folder in a shared /tmp, a cache others
    may write, a folder above it others may write), a fresh private folder for this process instead, said once
    on stderr."""
    root = cache_dir()
    problem = None
    try:
        _private_dirs(root, root / key)
    except OSError:  # a read-only home (a sandbox, a shared account): the temporary directory instead
        user = os.getuid() if hasattr(os, "getuid") else 0
        root = pathlib.Path(tempfile.gettempdir()) / f"txl_tf-kernels-{user}"
        try:
            _private_dirs(root, root / key)
        except OSError as e:  # e.g. another user's folder of that name, closed to this one
            problem = f"cannot create {root / key}: {e.strerror or e}"
    target = root / key / "fused_ops.so"
    problem = problem or _untrusted_path(root, target)
    if problem is None:
        return target
    return _private_build_dir(root, problem) / "fused_ops.so"


def _private_folder(prefix: str) -> pathlib.Path:
    """A fresh folder only this user may enter (`tempfile.mkdtemp`: mode 0700), removed at exit; OSError (with the
    reason) when the temporary directory's folders may be another user's (`untrusted_path`)."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    problem = untrusted_path(folder)
    if problem:
        shutil.rmtree(folder, ignore_errors=True)
        raise OSError(f"{problem} (set TMPDIR to a directory only you can write)")
    return folder


def _private_build_dir(root, problem: str) -> pathlib.Path:
    """A private folder to build the kernels in for this process, said once on stderr: `root` holds a library
    another user may have put there (`problem`)."""
    private = _private_folder("txl_tf-kernels-private-")
    logging.warning("txl_tf: not loading the fused CPU kernels from %s (%s; another user could have put a library "
                    "there); building them in %s for this process instead (remove that folder, or set TXL_TF_CACHE "
                    "to a directory only you can write)", root, problem, private)
    return private


def _checked_copy(target: pathlib.Path) -> pathlib.Path:
    """A copy of the library `target` in a fresh private folder, read through the one descriptor that was checked:
    `target` opened without following a link, and a regular file of this user that no one else may write by
    `fstat` of that descriptor. Raises _Untrusted (why it may be another user's), FileNotFoundError or OSError."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(target, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _Untrusted(f"{target} is a symbolic link") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _Untrusted(f"{target} is not a regular file")
        reason = owner_problem(info) if hasattr(os, "getuid") else None
        if reason:
            raise _Untrusted(f"{target} is {reason}")
        if info.st_size > _LIBRARY_LIMIT:
            raise _Untrusted(f"{target} holds {info.st_size} bytes, more than a build of the kernels")
        copy = _private_folder("txl_tf-kernels-load-") / target.name
        out = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o500)
        with os.fdopen(out, "wb") as f:
            while chunk := os.read(fd, 1 << 20):
                f.write(chunk)
        return copy
    finally:
        os.close(fd)


def _load_checked(target: pathlib.Path):
    """`tf.load_op_library` of exactly the file `target` that was checked (`_checked_copy`); the copy is removed
    once loaded (the process keeps it mapped)."""
    copy = _checked_copy(target)
    try:
        return tf.load_op_library(str(copy))
    finally:
        shutil.rmtree(copy.parent, ignore_errors=True)


def _build_logged(compiler, target):
    """`_build` said in one info line; None or the reason it failed."""
    logging.info("txl_tf: compiling the fused CPU kernels into %s (once per machine and version, ~10 s)",
                 target.parent)
    try:
        return _build(compiler, target)
    except OSError as e:
        return f"cannot build in {target.parent}: {e} (set TXL_TF_CACHE to a writable directory)"


def _build(compiler, target):
    """Compiles SOURCE into `target` (atomically); returns None or the reason it failed."""
    make_private_dirs(target.parent)
    log = target.with_suffix(".log")
    tf_flags = tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()
    errors = []
    # -march=native first (the CPU's widest vector units, e.g. AVX-512, for exp and the bfloat16 conversions);
    # without it if the compiler does not know the flag for this CPU.
    for arch in (["-march=native"], []):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [compiler, *_BASE_FLAGS, *arch, str(SOURCE), "-o", tmp, *tf_flags]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:  # the compiler named by $CXX does not run at all
            os.unlink(tmp)
            return f"cannot run the compiler {compiler!r}: {e} (install g++, or set CXX)"
        if result.returncode == 0:
            os.chmod(tmp, stat.S_IMODE(os.stat(tmp).st_mode) & ~0o022)  # the linker's mode follows the umask
            os.replace(tmp, target)  # atomic: a concurrent process sees the old state or the whole library
            return None
        os.unlink(tmp)
        errors.append(f"$ {' '.join(cmd)}\n{result.stderr}")
    log.write_text("\n\n".join(errors))
    return f"{compiler} failed; its output is in {log}"


_LOAD_LOCK = threading.Lock()


def _load():
    """(library module, None) or (None, reason); built and loaded once per process. MirroredStrategy traces its
    replicas in concurrent threads, so the first calls may race: they wait for one build and one registration."""
    with _LOAD_LOCK:
        return _load_once()


@functools.cache
def _load_once():
    if not SOURCE.exists():
        return None, f"{SOURCE} is missing"
    compiler = _compiler()
    if compiler is None:
        return None, "no C++ compiler (install g++, or set CXX)"
    try:
        target = _library_path(_cache_key(compiler))
    except OSError as e:
        return None, f"no folder to build the kernels in: {e} (set TXL_TF_CACHE to a writable directory)"
    for attempt in range(2):
        if not target.exists():
            reason = _build_logged(compiler, target)
            if reason:
                return None, reason
        try:
            library = _load_checked(target)
            break
        except _Untrusted as e:  # what was there when opened is not what was checked: another user's, perhaps
            if attempt:
                return None, f"cannot load {target}: {e}"
            try:
                target = _private_build_dir(target.parent.parent, str(e)) / "fused_ops.so"
            except OSError as error:
                return None, f"no private folder to build the kernels in: {error}"
        except (tf.errors.NotFoundError, OSError) as e:
            return None, f"cannot load {target}: {e}"
    _register_gradients()
    return library, None


@functools.cache
def _register_gradients():
    @tf.RegisterGradient("TxlRelSoftmax")
    def _rel_softmax_grad(op, grad_probs, grad_lse):
        del grad_lse  # lse is for the backward pass only; nothing differentiates through it
        content, position, bias = op.inputs
        d_content, d_position = _library_or_raise().txl_rel_softmax_grad(grad_probs, content, position, bias,
                                                                         op.outputs[1])
        return d_content, d_position, None

    @tf.RegisterGradient("TxlAddLayerNorm")
    def _add_layer_norm_grad(op, grad_y, grad_mean, grad_rstd):
        del grad_mean, grad_rstd  # kept for the backward pass only
        x, residual, gamma, _ = op.inputs
        d_sum, d_gamma, d_beta = _library_or_raise().txl_add_layer_norm_grad(grad_y, x, residual, gamma,
                                                                             op.outputs[1], op.outputs[2])
        return d_sum, d_sum, d_gamma, d_beta

    @tf.RegisterGradient("TxlBiasReluDropout")
    def _bias_relu_dropout_grad(op, grad):
        d_z, d_bias = _library_or_raise().txl_bias_relu_dropout_grad(grad, op.outputs[0],
                                                                     scale=op.get_attr("scale"))
        return d_z, d_bias, None

    @tf.RegisterGradient("TxlSplitHeads")
    def _split_heads_grad(op, *grads):
        grads = [tf.zeros_like(out) if g is None else g for g, out in zip(grads, op.outputs, strict=True)]
        return _library_or_raise().txl_merge_heads(grads, num_heads=op.get_attr("num_heads"))

    @tf.RegisterGradient("TxlMergeHeads")
    def _merge_heads_grad(op, grad):
        return _library_or_raise().txl_split_heads(grad, num_heads=op.get_attr("num_heads"),
                                                   num_splits=op.get_attr("num_splits"))

    @tf.RegisterGradient("TxlDropout")
    def _dropout_grad(op, grad):
        # The same seed draws the same mask: the gradient is dropped and scaled exactly as the input was.
        return (_library_or_raise().txl_dropout(grad, op.inputs[1], threshold=op.get_attr("threshold"),
                                               scale=op.get_attr("scale")), None)


def unavailable() -> str | None:
    """Why this process cannot run the kernels (no C++ compiler, a failed build, a library that does not load), or
    None: the library is built (once per machine, source and TensorFlow version) and loaded."""
    return _load()[1]


def describe(kernels: str) -> str:
    """What a `TrainConfig.kernels` value runs, for logs and benchmarks."""
    if kernels == "fused":
        return "fused C++ CPU kernels in training steps (txl_tf/model/fused.py)"
    if kernels == "tf":
        return "TensorFlow's ops"
    raise ValueError(f"kernels={kernels!r}: use one of {', '.join(KERNELS)}")


def applies(enabled: bool, dtype, training) -> bool:
    """Whether a layer call uses the kernels: the call's training policy asks for them (`enabled`), the call
    is a training call (`training is True`: inference and export keep TensorFlow's ops) and the compute dtype is
    float32 or bfloat16. A pure function of its arguments, so a traced step depends on the configuration only."""
    return bool(enabled) and training is True and tf.as_dtype(dtype) in (tf.float32, tf.bfloat16)


def rel_softmax(content, position, bias):
    """softmax(content + shift_padded(position) + bias) over the last axis, as one kernel each way.

    Args:
      content: [..., L, K] float32 or bfloat16, the content scores (a) + (c).
      position: [..., L, K+1] of content's dtype, the position scores (b) + (d) against the zero-padded R, in
        the layout `attention.shift_padded` takes.
      bias: additive mask broadcastable to [L, K] (any float dtype; None for none).

    Returns:
      [..., L, K] probabilities in content's dtype (computed in float32).
    """
    shape = tf.shape(content)
    qlen, klen = shape[-2], shape[-1]
    bias = tf.zeros([qlen, klen], tf.float32) if bias is None else tf.broadcast_to(tf.cast(bias, tf.float32),
                                                                                      [qlen, klen])
    probs, _ = _library_or_raise().txl_rel_softmax(
        tf.reshape(content, [-1, qlen, klen]), tf.reshape(position, [-1, qlen, klen + 1]), bias)
    return tf.reshape(probs, shape)


def dropout(x, seed, threshold, scale):
    """Inverted dropout in one pass: zero where 16 Philox bits keyed by `seed` fall below `threshold` (of 65536),
    else `x * scale`; the gradient draws the same mask again.

    Args:
      x: any shape, float32 or bfloat16.
      seed: [2] int32.
      threshold: int in [0, 65536); scale: the factor of kept elements (1 / (1 - rate)).
    """
    return _library_or_raise().txl_dropout(x, tf.cast(seed, tf.int32), threshold=threshold, scale=scale)


def add_layer_norm(norm, x, residual, kernels):
    """`norm(x + residual)` for a `keras.layers.LayerNormalization` over the last axis: the post-norm residual.

    With `kernels` (the caller's `applies(...)`) one kernel each way (`TxlAddLayerNorm`, the sum and the statistics
    in float32) where the norm fits it; otherwise the layer itself. Both give Keras' result within float32
    rounding (`tests/test_fused.py`).

    Args:
      norm: a built `keras.layers.LayerNormalization` (axis -1, center and scale, no rms_scaling).
      x, residual: [..., d] of the compute dtype.
      kernels: whether this call uses the kernels (`applies`).
    """
    axes = norm.axis if isinstance(norm.axis, (list, tuple)) else [norm.axis]
    kernel_fits = ([axis % x.shape.rank for axis in axes] == [x.shape.rank - 1] and norm.center and norm.scale
                   and not norm.rms_scaling)
    if not kernels or not kernel_fits:
        return norm(x + residual)
    width = x.shape[-1]
    with tf.name_scope(norm.name):  # the layer's own scope, as Keras' path has (profiles group ops by scope)
        y, _, _ = _library_or_raise().txl_add_layer_norm(
            tf.reshape(x, [-1, width]), tf.reshape(residual, [-1, width]), tf.cast(norm.gamma, tf.float32),
            tf.cast(norm.beta, tf.float32), epsilon=norm.epsilon)
    return tf.reshape(y, tf.shape(x))


def bias_relu_dropout(z, bias, seed, threshold, scale):
    """Inverted dropout of relu(z + bias) in one pass, with `dropout`'s bits for `seed` (threshold 0: none dropped);
    the gradient is one pass over the output.

    Args:
      z: [M, F] float32 or bfloat16, the first feed-forward matmul without its bias.
      bias: [F] (added in float32).
      seed: [2] int32; threshold: int in [0, 65536); scale: the factor of kept elements.
    """
    return _library_or_raise().txl_bias_relu_dropout(z, tf.cast(bias, tf.float32), tf.cast(seed, tf.int32),
                                                     threshold=threshold, scale=scale)


def split_heads(x, num_heads, num_splits=1):
    """[B, T, S*N*D] -> S tensors [N, B, T, D]: `tf.split` into S parts along the last axis, each reshaped to
    [B, T, N, D] and transposed to heads first, as one copy (`TxlSplitHeads`; its gradient is `merge_heads`).

    Args:
      x: [B, T, S*N*D] float32 or bfloat16 (the last axis divisible by S*N).
      num_heads: N; num_splits: S.

    Returns:
      a list of S tensors [N, B, T, D].
    """
    return list(_library_or_raise().txl_split_heads(x, num_heads=num_heads, num_splits=num_splits))


def merge_heads(heads, num_heads):
    """The inverse of `split_heads`: S tensors [N, B, T, D] (N = num_heads) -> [B, T, S*N*D] (`TxlMergeHeads`)."""
    return _library_or_raise().txl_merge_heads(list(heads), num_heads=num_heads)


def _library_or_raise():
    library_, reason = _load()
    if library_ is None:
        raise RuntimeError(f"the fused CPU kernels are unavailable: {reason}; train without them "
                           "(TrainConfig.kernels='tf')")
    return library_
