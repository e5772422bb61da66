"""Readers of Wan model parts in the layouts users hold them (DESIGN.md section 9): diffusers folders, the official
Wan release, ComfyUI single files. Parts are recognised by tensor names and shapes, never by file names."""
