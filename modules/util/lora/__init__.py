"""LoRA file formats: key names (keys), COMFY/KOHYA/DIFFUSERS and peer layouts (formats), LyCORIS (lycoris), applying a file to a model (apply), converting and merging (convert)."""
