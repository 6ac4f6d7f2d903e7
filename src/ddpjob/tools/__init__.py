"""Operator commands: ``ddpjob doctor`` (this node) and ``doctor --all-nodes``, ``diagnose``,
``plot``, ``ckpt inspect|convert``. None of them imports the training loop.
"""
