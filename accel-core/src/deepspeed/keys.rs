//! Every key of a DeepSpeed configuration, sorted by what accel-rs does with
//! it: read by the plan, or listed at start-up as having no effect here
//! (with why). Keys in neither list are unknown to DeepSpeed's documented
//! schema and are listed too, so a typo never passes silently.

use serde_json::Value;

/// Keys the plan reads (dotted, `*` for any child).
const ACTED: &[&str] = &[
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer.type",
    "optimizer.params.*",
    "scheduler.type",
    "scheduler.params.*",
    "fp16.enabled",
    "fp16.loss_scale",
    "fp16.initial_scale_power",
    "fp16.loss_scale_window",
    "bf16.enabled",
    "zero_optimization.stage",
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_param.device",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.gather_16bit_weights_on_model_save",
    "zero_allow_untested_optimizer",
];

/// Keys DeepSpeed knows that change nothing here, with the reason.
const INERT: &[(&str, &str)] = &[
    ("steps_per_print", "progress is logged by `logging_steps`"),
    ("wall_clock_breakdown", "no per-phase timers are kept"),
    ("memory_breakdown", "no per-phase memory report is kept"),
    (
        "dump_state",
        "the resolved configuration is printed at start-up instead",
    ),
    (
        "communication_data_type",
        "gradients are reduced in fp32 (or as `ddp_comm_hook` says)",
    ),
    (
        "prescale_gradients",
        "gradients are averaged after the reduction",
    ),
    (
        "gradient_predivide_factor",
        "gradients are averaged after the reduction",
    ),
    ("sparse_gradients", "gradients are dense"),
    (
        "fp16.hysteresis",
        "the loss scale backs off at the first overflow (PyTorch's GradScaler)",
    ),
    (
        "fp16.min_loss_scale",
        "the loss scale has no floor (PyTorch's GradScaler)",
    ),
    (
        "fp16.consecutive_hysteresis",
        "the loss scale backs off at the first overflow",
    ),
    (
        "fp16.auto_cast",
        "inputs are cast by the model's compute dtype",
    ),
    (
        "bf16.immediate_grad_update",
        "gradients are applied at the optimizer step",
    ),
    (
        "zero_optimization.allgather_partitions",
        "gathers are per unit, sized by the unit",
    ),
    (
        "zero_optimization.allgather_bucket_size",
        "gathers are per unit, sized by the unit",
    ),
    (
        "zero_optimization.overlap_comm",
        "collectives run when a unit needs them",
    ),
    (
        "zero_optimization.reduce_scatter",
        "gradients are always reduce-scattered under ZeRO-2/3",
    ),
    (
        "zero_optimization.reduce_bucket_size",
        "reductions are per unit",
    ),
    (
        "zero_optimization.contiguous_gradients",
        "each unit's gradients are one flat buffer already",
    ),
    (
        "zero_optimization.sub_group_size",
        "the optimizer steps each parameter's piece",
    ),
    (
        "zero_optimization.stage3_prefetch_bucket_size",
        "units gather when they run; no prefetch",
    ),
    (
        "zero_optimization.prefetch_bucket_size",
        "units gather when they run; no prefetch",
    ),
    (
        "zero_optimization.stage3_param_persistence_threshold",
        "every parameter of a unit is sharded",
    ),
    (
        "zero_optimization.param_persistence_threshold",
        "every parameter of a unit is sharded",
    ),
    (
        "zero_optimization.stage3_max_live_parameters",
        "units are released after their forward",
    ),
    (
        "zero_optimization.max_live_parameters",
        "units are released after their forward",
    ),
    (
        "zero_optimization.stage3_max_reuse_distance",
        "units are released after their forward",
    ),
    (
        "zero_optimization.max_reuse_distance",
        "units are released after their forward",
    ),
    (
        "zero_optimization.round_robin_gradients",
        "gradients are reduced in unit order",
    ),
    (
        "zero_optimization.elastic_checkpoint",
        "checkpoints resume at any world size (FULL_STATE_DICT)",
    ),
    (
        "zero_optimization.ignore_unused_parameters",
        "see `ddp_find_unused_parameters`",
    ),
    (
        "zero_optimization.load_from_fp32_weights",
        "the fp32 master weights are always what is saved",
    ),
    (
        "zero_optimization.offload_optimizer.pin_memory",
        "on a CPU run the state is in host memory already",
    ),
    (
        "zero_optimization.offload_optimizer.buffer_count",
        "no NVMe buffers are used",
    ),
    (
        "zero_optimization.offload_optimizer.fast_init",
        "no NVMe buffers are used",
    ),
    (
        "zero_optimization.offload_optimizer.ratio",
        "the whole optimizer state is offloaded",
    ),
    (
        "zero_optimization.offload_param.pin_memory",
        "on a CPU run the parameters are in host memory already",
    ),
    (
        "zero_optimization.offload_param.buffer_count",
        "no NVMe buffers are used",
    ),
    (
        "zero_optimization.offload_param.buffer_size",
        "no NVMe buffers are used",
    ),
    (
        "zero_optimization.offload_param.max_in_cpu",
        "no NVMe buffers are used",
    ),
    (
        "zero_optimization.zero_hpz_partition_size",
        "ZeRO++ hierarchical partitioning is not built",
    ),
    (
        "zero_optimization.zero_quantized_weights",
        "ZeRO++ quantized weights are not built",
    ),
    (
        "zero_optimization.zero_quantized_gradients",
        "ZeRO++ quantized gradients are not built",
    ),
    (
        "zero_optimization.zero_quantized_nontrainable_weights",
        "ZeRO++ quantized weights are not built",
    ),
    (
        "zero_optimization.mics_shard_size",
        "MiCS sharding is not built",
    ),
    (
        "zero_optimization.mics_hierarchical_params_gather",
        "MiCS sharding is not built",
    ),
    (
        "zero_optimization.stage3_module_granularity_threshold",
        "units come from the wrap policy",
    ),
    (
        "zero_optimization.cpu_offload",
        "the legacy flag: use offload_optimizer.device",
    ),
    (
        "zero_force_ds_cpu_optimizer",
        "the optimizer is accel-rs' own on every device",
    ),
    (
        "activation_checkpointing",
        "use the FSDP plugin's activation checkpointing",
    ),
    ("flops_profiler", "no profiler is built"),
    ("tensorboard", "DeepSpeed's monitors: use `report_to`"),
    ("wandb", "DeepSpeed's monitors: use `report_to`"),
    ("csv_monitor", "DeepSpeed's monitors: use `report_to`"),
    ("comet", "DeepSpeed's monitors: use `report_to`"),
    ("aio", "no NVMe offload is used"),
    (
        "checkpoint",
        "checkpoints are the Accelerator's (`save_state`)",
    ),
    ("elasticity", "the world size is the launcher's"),
    ("data_efficiency", "the data loader is accel-rs' own"),
    ("compression_training", "no compression is built"),
    (
        "seq_parallel_communication_data_type",
        "no sequence parallelism is built",
    ),
];

/// The start-up lines for the keys of `config` that have no effect here:
/// each inert key with why, each unknown key as unknown.
pub(super) fn inert(config: &Value) -> Vec<String> {
    let mut out = vec![];
    walk(config, "", &mut out);
    out
}

fn walk(v: &Value, prefix: &str, out: &mut Vec<String>) {
    let Value::Object(map) = v else { return };
    for (k, child) in map {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        if ACTED.iter().any(|a| matches(a, &key)) {
            continue;
        }
        // A disabled fp16 section's loss-scale settings act nowhere.
        if key.starts_with("fp16.") && !map.get("enabled").is_some_and(|e| e == true) {
            continue;
        }
        if let Some((_, why)) = INERT.iter().find(|(i, _)| *i == key) {
            out.push(format!(
                "DeepSpeed setting `{key}` has no effect in accel-rs: {why}"
            ));
            continue;
        }
        // A section: its children are sorted out one by one.
        if child.is_object() && ACTED.iter().any(|a| a.starts_with(&format!("{key}."))) {
            walk(child, &key, out);
            continue;
        }
        out.push(format!(
            "DeepSpeed setting `{key}` is not a DeepSpeed key accel-rs knows: it has no effect"
        ));
    }
}

/// Whether `key` is `pattern` or under its `.*`.
fn matches(pattern: &str, key: &str) -> bool {
    match pattern.strip_suffix(".*") {
        Some(p) => key
            .strip_prefix(p)
            .is_some_and(|rest| rest.starts_with('.')),
        None => pattern == key,
    }
}
