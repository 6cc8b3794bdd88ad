"""The phase rules of `memplan.rl.phases`, on hand-made figures (bytes in MiB units)."""

from memplan.rl.phases import EngineFigures, PhaseOptions, StepFigures, assemble_phases

M = 1 << 20


def figures(**over):
    engine = EngineFigures(weights_bytes=1000 * M, kv_bytes=2000 * M, activation_bytes=100 * M, graphs_bytes=50 * M,
                           non_torch_bytes=10 * M, nccl_bytes=0, refusal=None)
    base = dict(outside_bytes=500 * M, extra_contexts={}, policy_bytes=1000 * M, optimizer_bytes=2000 * M,
                reference_bytes=0, critic_bytes=0, reward_bytes=0, train_allocated_bytes=6000 * M,
                train_reserved_bytes=7000 * M, logprob_transient_bytes=300 * M, reference_transient_bytes=300 * M,
                logprob_cached_bytes=0,
                reward_transient_bytes=0, critic_train_extra_bytes=0, sync_gather_bytes=0, engine=engine)
    base.update(over)
    return StepFigures(**base)


def options(**over):
    base = dict(rollout="vllm-colocate", sleep_level=0, empty_cache_before_wake=True, old_logprobs=True,
                reference_logprobs=False, algo="grpo")
    base.update(over)
    return PhaseOptions(**base)


def by_name(phases):
    return {p.name: p for p in phases}


def test_the_engine_starts_before_any_optimizer_state_exists():
    start = by_name(assemble_phases(figures(), options()))["engine start (step 1)"]
    labels = {i.label: i.bytes for i in start.items}
    assert "optimizer state" not in labels
    assert start.device_used_bytes == (500 + 1000 + 1000 + 2000 + 50 + 10 + 100) * M


def test_without_sleep_the_training_step_holds_the_engine_and_its_own_reserved_peak():
    train = by_name(assemble_phases(figures(), options()))["training step"]
    # context 500 + engine weights 1000 + KV 2000 + graphs 50 + non-torch 10 + the step's reserved 7000
    assert train.device_used_bytes == (500 + 1000 + 2000 + 50 + 10 + 7000) * M
    assert train.allocator_bytes("cumem") == 0


def test_sleep_level_2_keeps_only_graphs_and_non_torch_memory_during_training():
    train = by_name(assemble_phases(figures(), options(sleep_level=2)))["training step"]
    assert train.device_used_bytes == (500 + 50 + 10 + 7000) * M
    assert train.allocator_bytes("cumem") == 0


def test_sleep_mode_puts_the_engine_weights_and_kv_cache_in_the_cumem_pool_while_generating():
    rollout = by_name(assemble_phases(figures(), options(sleep_level=2)))["rollout (vLLM generate)"]
    assert rollout.allocator_bytes("cumem") == (1000 + 2000) * M


def test_empty_cache_before_wake_up_frees_the_training_steps_cache_for_the_engine():
    emptied = by_name(assemble_phases(figures(), options(sleep_level=2)))["weight sync"]
    kept = by_name(assemble_phases(figures(), options(sleep_level=2, empty_cache_before_wake=False)))["weight sync"]
    # the trainer's residents are 3000 of the 7000 the step reserved: 4000 stay cached without empty_cache()
    assert kept.device_used_bytes - emptied.device_used_bytes == 4000 * M
    assert emptied.cached_bytes == 0


def test_a_log_prob_pass_sits_on_the_trainers_residents_and_the_engine_residue():
    phases = by_name(assemble_phases(figures(train_reserved_bytes=3000 * M), options(sleep_level=2)))
    lp = phases["policy log-probs"]
    assert lp.device_used_bytes == (500 + 1000 + 2000 + 50 + 10 + 300) * M


def test_a_server_rollout_leaves_no_engine_on_the_trainers_gpu():
    phases = assemble_phases(figures(sync_gather_bytes=400 * M), options(rollout="vllm-server"))
    assert [p.name for p in phases] == ["weight sync (to a server)", "policy log-probs", "training step"]
    assert all(p.allocator_bytes("cumem") == 0 for p in phases)
    assert phases[0].device_used_bytes == (500 + 7000) * M  # the step's cache holds more than 3000 + 400


def test_pytorchs_free_cache_counts_against_a_vllm_wake_up_but_not_against_pytorch_itself():
    kept = by_name(assemble_phases(figures(), options(sleep_level=2, empty_cache_before_wake=False)))
    assert kept["weight sync"].needed_bytes == kept["weight sync"].device_used_bytes  # CuMem cannot use the cache
    lp = kept["policy log-probs"]  # PyTorch frees its cache and retries before an out-of-memory error
    assert lp.cached_bytes > 0 and lp.needed_bytes == lp.device_used_bytes - lp.cached_bytes


def test_parameters_on_the_host_leave_the_engine_start_and_the_generation_and_come_back_for_the_rest():
    phases = by_name(assemble_phases(figures(), options(sleep_level=2, params_on_host=True)))
    policy = {name: {i.label: i.bytes for i in p.items}["policy parameters"] for name, p in phases.items()}
    assert policy == {"engine start (step 1)": 0, "weight sync": 1000 * M, "rollout (vLLM generate)": 0,
                      "policy log-probs": 1000 * M, "training step": 1000 * M}


def test_optimizer_state_on_the_host_is_on_the_gpu_for_the_update_only():
    phases = by_name(assemble_phases(figures(), options(sleep_level=2, optimizer_on_host=True)))
    held = {name: {i.label: i.bytes for i in p.items}.get("optimizer state") for name, p in phases.items()}
    assert held == {"engine start (step 1)": None, "weight sync": 0, "rollout (vLLM generate)": 0,
                    "policy log-probs": 0, "training step": 2000 * M}
    # sleep level 2 keeps the context 500, graphs 50 and non-torch 10; the rollout adds policy
    # 1000, engine weights 1000 + KV 2000 (CuMem) and its activations 100
    assert phases["rollout (vLLM generate)"].needed_bytes == (500 + 1000 + 1000 + 2000 + 50 + 10 + 100) * M


def test_a_log_prob_pass_that_offloads_the_parameters_after_it_empties_the_cache():
    big_pass = figures(logprob_transient_bytes=9000 * M)
    kept = by_name(assemble_phases(big_pass, options(sleep_level=2)))["training step"]
    emptied = by_name(assemble_phases(big_pass, options(sleep_level=2, params_on_host=True)))["training step"]
    # the pass reserves policy 1000 + optimizer 2000 + 9000; kept, the step holds all 12000;
    # after verl's offload and empty_cache() the step reserves its own 7000 again
    assert kept.allocator_bytes("torch") == 12000 * M
    assert emptied.allocator_bytes("torch") == 7000 * M


def test_an_offload_that_empties_the_cache_after_the_update_leaves_step_2_only_the_residents():
    kept = by_name(assemble_phases(figures(), options(rollout="vllm-server", optimizer_on_host=True)))
    emptied = by_name(assemble_phases(figures(), options(rollout="vllm-server", optimizer_on_host=True,
                                                         empty_cache_after_update=True)))
    sync = "weight sync (to a server)"
    # the step's 7000 stay reserved without it; with it, the policy's 1000 (its optimizer state is on the host)
    assert kept[sync].allocator_bytes("torch") == 7000 * M
    assert emptied[sync].allocator_bytes("torch") == 1000 * M
