"""Training a LoRA on a tiny Wan2.2-Animate model: the run goes end to end on the synthetic Animate set, the loss
leaves out the reference and continuation frames, and the saved COMFY LoRA (its header naming the variant) loads in
diffusers' WanAnimatePipeline and changes the transformer's output exactly as the trained adapter does."""
import json

import pytest
import torch
from diffusers import WanAnimatePipeline
from safetensors import safe_open

from modules.util.demo_animate import make_animate_dataset
from tests.learning import train


def train_lora_briefly(work, base, overrides=()):
    """Two LoRA steps on the one-clip-per-class Animate set (5 frames of 32 x 32): (trainer, the saved file)."""
    data = make_animate_dataset(work / "data", clips_per_class=1, frames=5, size=32)
    trainer = train(work, base, data, steps=2, overrides=["data.frame_buckets=[5]", "optimizer.learning_rate=0.01",
                                                          "lora.rank=4", *overrides])
    return trainer, work / "out.safetensors"


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    return train_lora_briefly(tmp_path_factory.mktemp("animate-train"), tiny_model("wan2.2-animate"),
                              ["lora.alpha=4", "animate.continuation_frames=1"])


def _inputs(transformer):
    generator = torch.Generator().manual_seed(3)
    size = transformer.config.motion_encoder_size
    return dict(hidden_states=torch.randn(1, 36, 3, 4, 4, generator=generator), timestep=torch.tensor([700.0]),
                encoder_hidden_states=torch.randn(1, 512, transformer.config.text_dim, generator=generator),
                encoder_hidden_states_image=torch.randn(1, 17, transformer.config.image_dim, generator=generator),
                pose_hidden_states=torch.randn(1, 16, 2, 4, 4, generator=generator),
                face_pixel_values=torch.rand(1, 3, 5, size, size, generator=generator) * 2 - 1)


def test_lora_loads_in_the_pipeline_and_changes_output_as_in_training(trained, tiny_model):
    trainer, lora = trained
    with safe_open(str(lora), framework="pt") as file:
        assert file.metadata()["modelspec.architecture"] == "wan_2_2_animate_14b/lora"
        assert any(k.startswith("diffusion_model.blocks.") for k in file.keys())
    ours = trainer.model.transformer
    ours.eval()
    pipe = WanAnimatePipeline.from_pretrained(tiny_model("wan2.2-animate"), torch_dtype=torch.float32)
    with torch.no_grad():
        base = pipe.transformer(**_inputs(pipe.transformer)).sample
        pipe.load_lora_weights(str(lora))
        theirs = pipe.transformer(**_inputs(pipe.transformer)).sample
        trained_output = ours(**_inputs(ours)).sample
    assert (trained_output - base).abs().max() > 1e-3   # the LoRA changed the output
    torch.testing.assert_close(theirs, trained_output, rtol=0, atol=1e-5)


def test_loss_leaves_out_the_reference_and_continuation_frames(trained):
    trainer, _ = trained
    batch = next(trainer.data.batches(0))
    assert batch["loss_mask"][0].flatten().tolist() == [0.0, 0.0, 1.0]
    prediction = trainer.setup.predict(batch, torch.Generator().manual_seed(0))
    loss = trainer.setup.calculate_loss(batch, prediction)
    # anything predicted on the condition frames changes nothing; on a target frame it does
    prediction.predicted[:, :, :2] += 100.0
    assert trainer.setup.calculate_loss(batch, prediction) == loss
    prediction.predicted[:, :, 2:] += 1.0
    assert trainer.setup.calculate_loss(batch, prediction) != loss


def test_checkpointed_face_adapter_gives_the_same_gradients(tiny_model):
    """With gradient checkpointing the face adapter blocks are recomputed in the backward pass (the planner counts
    13 GiB of activations at 14B without it): same output and gradients, fewer saved tensors."""
    from diffusers import WanAnimateTransformer3DModel

    from modules.modelSetup.memory.FaceAdapterCheckpointing import checkpoint_face_adapter
    results = []
    for checkpointed in (False, True):
        model = WanAnimateTransformer3DModel.from_pretrained(tiny_model("wan2.2-animate"), subfolder="transformer")
        if checkpointed:
            assert checkpoint_face_adapter(model) == 1
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            output = model(**_inputs(model)).sample
        output.square().mean().backward()
        results.append((output.detach(), model.face_adapter[0].to_q.weight.grad.clone(),
                        model.blocks[0].attn1.to_q.weight.grad.clone(), sum(saved)))
    (plain, *plain_grads, plain_saved), (ours, *our_grads, our_saved) = results
    torch.testing.assert_close(ours, plain, rtol=0, atol=0)
    for a, b in zip(our_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert our_saved < plain_saved


def test_an_animate_lora_on_another_model_is_refused(trained, tiny_model):
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.modelSampler.WanModelSampler import SampleError
    from modules.modelSampler.sampling_io import apply_lora_files
    from modules.util.config.ModelConfig import ModelConfig
    _, lora = trained
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-t2v"))))
    with pytest.raises(SampleError, match="made for wan_2_2_animate_14b .*Wan 2.2 Animate 14B.*the model is T2V"):
        apply_lora_files(model, [(lora, 1.0)])


def test_fine_tune_leaves_the_motion_and_face_encoders_frozen(tiny_model):
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.util.config.ModelConfig import ModelConfig
    from modules.util.config.config_io import load_config
    from modules.modelSetup.WanFineTuneSetup import WanFineTuneSetup
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.2-animate"))))
    for layer_filter, motion_trains in (([], False), (["motion_encoder", "blocks"], True)):
        config = load_config(overrides=["training_method=FINE_TUNE", "model_type=WAN_2_2", "device=cpu",
                                        "train_dtype=FLOAT_32", "gradient_checkpointing=false",
                                        f"fine_tune.layer_filter={json.dumps(layer_filter)}"])
        setup = WanFineTuneSetup(config, model)
        setup.setup_model()
        trained = {name.split(".")[1] for name, _ in setup.named_trainable_parameters()}
        assert "blocks" in trained and ("motion_encoder" in trained) == motion_trains
        assert ("face_encoder" in trained) is False


def test_an_animate_lora_for_sampling_another_model_is_refused_before_its_weights_load(trained, tiny_model,
                                                                                        monkeypatch):
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.modelSampler.WanModelSampler import SampleError
    from modules.modelSampler.sampling_io import load_model_for_sampling
    from modules.util.enum.DataType import DataType
    _, lora = trained
    monkeypatch.setattr(WanBaseModelLoader, "load", lambda *_: pytest.fail("the weights were loaded"))
    with pytest.raises(SampleError, match="made for wan_2_2_animate_14b .*the model is T2V.*only on its Animate"):
        load_model_for_sampling(str(tiny_model("wan2.1-t2v")), DataType.FLOAT_32, torch.device("cpu"),
                                loras=[(lora, 1.0)])


def test_a_full_fine_tune_saves_in_the_official_layout_and_loads_back(tiny_model, tmp_path):
    """The ORIGINAL writer names the motion / face encoders and the face adapter as the official files do (stacked
    linear1_kv, (1, C, 1, 1) biases, blur kernels); our reader takes the file back to the trained transformer."""
    from safetensors import safe_open

    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from modules.util.config.ModelConfig import ModelConfig, PartConfig
    data = make_animate_dataset(tmp_path / "data", clips_per_class=1, frames=5, size=32)
    trainer = train(tmp_path, tiny_model("wan2.2-animate"), data, "FINE_TUNE", 1,
                    ["data.frame_buckets=[5]", "optimizer.learning_rate=0.01"])
    with safe_open(str(tmp_path / "out.safetensors"), framework="pt") as file:
        keys = set(file.keys())
    assert {"face_adapter.fuser_blocks.0.linear1_kv.weight", "motion_encoder.dec.direction.weight"} <= keys
    loaded = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.2-animate")),
                                                   transformer=PartConfig(path=str(tmp_path / "out.safetensors"))))
    base = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.2-animate")))).transformer
    ours = trainer.model.transformer.eval()
    with torch.no_grad():
        trained_output = ours(**_inputs(ours)).sample
        torch.testing.assert_close(loaded.transformer(**_inputs(loaded.transformer)).sample, trained_output,
                                   rtol=0, atol=1e-5)
        assert (base(**_inputs(base)).sample - trained_output).abs().max() > 1e-4   # the step changed it
