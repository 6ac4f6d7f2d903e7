"""Checkpoint formats, each on its own: one file (``single_file``), a DCP folder (``dcp_folder``),
Hugging Face safetensors (``hf_safetensors``). A format never imports another one or the loop.
"""
