"""Optimiser and learning-rate schedule of the original Transformer-XL training scripts.

Adam (beta1 0.9, beta2 0.999, epsilon 1e-8) with a learning rate that rises linearly from 0 to `learning_rate`
over `warmup_steps`, then follows a cosine from `learning_rate` down to `min_lr_ratio * learning_rate` at
`train_steps`, and stays at that floor afterwards:

    lr(t) = learning_rate * t / warmup_steps                                  t < warmup_steps
    lr(t) = learning_rate * (a + (1 - a) * (1 + cos(pi * (t - w) / (T - w))) / 2)   w <= t <= T,  a = min_lr_ratio

This is exactly `keras.optimizers.schedules.CosineDecay(0, T - w, alpha=a, warmup_target=lr, warmup_steps=w)`,
so the schedule is Keras's own (serialisable, evaluated on the optimizer's `iterations`). Gradient clipping by
global norm is done by the trainer on the gradient summed over all replicas (Keras's `global_clipnorm` would
clip each replica's partial gradient before the all-reduce).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from txl_tf.configs import TrainConfig


def learning_rate_schedule(config: TrainConfig) -> keras.optimizers.schedules.LearningRateSchedule:
    """Linear warm-up from 0 to `config.learning_rate`, then cosine decay to `min_lr_ratio * learning_rate`.

    The fields' ranges (learning_rate > 0, warmup_steps >= 0, train_steps >= 1, min_lr_ratio in [0, 1]) were checked
    when `config` was made (`txl_tf.configs.validate`)."""
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0,
        decay_steps=max(config.train_steps - config.warmup_steps, 1),
        alpha=config.min_lr_ratio,
        warmup_target=float(config.learning_rate),
        warmup_steps=config.warmup_steps,
    )


@keras.saving.register_keras_serializable(package="txl_tf")
class FusedAdam(keras.optimizers.Adam):
    """Keras Adam whose per-variable update is TensorFlow's fused `ResourceApplyAdam` kernel.

    The same update as `keras.optimizers.Adam` (m += (g - m)(1 - b1); v += (g^2 - v)(1 - b2);
    w -= lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps)), the same variables and checkpoint keys, in one op per
    variable instead of about ten elementwise ops and three assignments: on CPU the Keras update of the enwik8
    base model's 41M parameters took 3x longer than the fused kernel. Sparse gradients (IndexedSlices of an
    embedding) are made dense first, as Keras's own update does in effect.
    """

    def update_step(self, gradient, variable, learning_rate):
        if self.amsgrad or variable.dtype != tf.float32:
            return super().update_step(gradient, variable, learning_rate)
        index = self._get_variable_index(variable)
        m, v = self._momentums[index], self._velocities[index]
        step = tf.cast(self.iterations + 1, tf.float32)
        beta_1, beta_2 = tf.constant(self.beta_1, tf.float32), tf.constant(self.beta_2, tf.float32)
        gradient = tf.cast(tf.convert_to_tensor(gradient), tf.float32)
        handle = lambda x: (x.value if isinstance(x, keras.Variable) else x).handle  # noqa: E731
        tf.raw_ops.ResourceApplyAdam(
            var=handle(variable), m=handle(m), v=handle(v), beta1_power=tf.pow(beta_1, step),
            beta2_power=tf.pow(beta_2, step), lr=tf.cast(learning_rate, tf.float32), beta1=beta_1, beta2=beta_2,
            epsilon=tf.constant(self.epsilon, tf.float32), grad=gradient, use_locking=False)


def make_optimizer(config: TrainConfig, schedule=None, *, global_clipnorm: bool = False
                   ) -> keras.optimizers.Optimizer:
    """Adam (`FusedAdam`) with `schedule` (default: the one above). Build it inside `strategy.scope()`, then call
    `optimizer.build(model.trainable_variables)` before the first distributed step.

    global_clipnorm: the optimizer clips the gradients by their global norm (TrainConfig.clip_norm) itself, as the
    custom trainer does before it applies them: the optimizer for `txl_tf.lm.hub.TransformerXLCausalLM.fit`."""
    return FusedAdam(
        learning_rate=learning_rate_schedule(config) if schedule is None else schedule,
        beta_1=config.adam_beta1,
        beta_2=config.adam_beta2,
        epsilon=config.adam_epsilon,
        global_clipnorm=config.clip_norm if global_clipnorm else None,
    )
