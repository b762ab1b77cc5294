"""Training: the trainer's step, the controller's loop, tf.distribute, the training-path autotuner and the schedules."""
