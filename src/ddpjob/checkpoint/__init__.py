"""Checkpoints: the manager the loop calls (begin, save, restore, prune), the formats (formats/),
checksums, the directory lock, atomic file-system steps, and model weights of any wrapper.
"""
