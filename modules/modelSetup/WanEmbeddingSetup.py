"""Textual inversion on UMT5: new placeholder tokens whose embedding rows are the only thing that trains."""
from pathlib import Path

import torch
from torch import Tensor

from modules.modelSetup.BaseWanSetup import BaseWanSetup
from modules.util.atomic import save_safetensors_atomic
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.enum.ModelType import ModelType
from modules.util.enum.TrainingMethod import TrainingMethod
from modules.util.modelspec import modelspec_metadata
from modules.util.registry import register

EMBEDDING_KEY = "umt5"


def placeholder_tokens(placeholder: str, count: int) -> list[str]:
    return [placeholder] + [f"{placeholder}_{i}" for i in range(1, count)]


@register("model_setup", [ModelType.WAN_2_1, ModelType.WAN_2_2], [TrainingMethod.EMBEDDING])
class WanEmbeddingSetup(BaseWanSetup):
    def setup_model(self) -> None:
        settings = self.config.embedding
        tokenizer, encoder = self.model.tokenizer, self.model.text_encoder
        self.tokens = placeholder_tokens(settings.placeholder, settings.vector_count)
        tokenizer.add_tokens(self.tokens, special_tokens=False)
        self.token_ids = tokenizer.convert_tokens_to_ids(self.tokens)
        table = encoder.get_input_embeddings()
        if max(self.token_ids) >= table.weight.shape[0]:
            # UMT5's matrix usually has spare rows past the tokenizer; grow it only when it has none left
            encoder.resize_token_embeddings(max(self.token_ids) + 1)
            table = encoder.get_input_embeddings()
        table.weight.data = table.weight.data.float()
        init_ids = tokenizer(settings.initial_text, add_special_tokens=False).input_ids or [tokenizer.unk_token_id]
        with torch.no_grad():
            for i, token_id in enumerate(self.token_ids):
                table.weight[token_id] = table.weight[init_ids[i % len(init_ids)]]
        self.frozen_rows = table.weight.detach().clone()
        self.apply_performance()
        self.row_mask = torch.zeros(table.weight.shape[0], 1, dtype=torch.bool)
        self.row_mask[self.token_ids] = True
        table.weight.requires_grad_(True)
        # only the new rows may change: their gradient alone survives, and after_optimizer_step restores the rest
        table.weight.register_hook(lambda grad: grad * self.row_mask.to(grad.device, grad.dtype))
        self.table = table

    def text_embeddings(self, batch: dict) -> Tensor:
        expanded = " ".join(self.tokens)
        prompts = [p.replace(self.config.embedding.placeholder, expanded) if len(self.tokens) > 1 else p
                   for p in batch["prompt"]]
        return self.model.encode_text(prompts)

    def after_optimizer_step(self) -> None:
        with torch.no_grad():
            mask = self.row_mask.to(self.table.weight.device)
            self.table.weight.copy_(torch.where(mask, self.table.weight, self.frozen_rows.to(self.table.weight)))

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [self.table.weight]

    def named_trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(EMBEDDING_KEY, self.table.weight)]

    def vectors(self) -> Tensor:
        return self.table.weight.detach()[self.token_ids].clone()

    def trainable_state_dict(self) -> dict[str, Tensor]:
        return {EMBEDDING_KEY: self.vectors()}

    def load_trainable_state_dict(self, state: dict[str, Tensor]) -> None:
        with torch.no_grad():
            self.table.weight[self.token_ids] = state[EMBEDDING_KEY].to(self.table.weight)

    def save_result(self, destination: str, output_format: ModelFormat, dtype: torch.dtype | None,
                    train_config: dict | None) -> list[Path]:
        metadata = modelspec_metadata(self.model.variant, train_config=train_config,
                                      title=f"embedding {self.config.embedding.placeholder}")
        metadata["placeholder"] = self.config.embedding.placeholder
        vectors = self.vectors()
        save_safetensors_atomic({EMBEDDING_KEY: vectors.to(dtype) if dtype else vectors}, destination, metadata)
        return [Path(destination)]
