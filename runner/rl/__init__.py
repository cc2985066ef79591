"""RL on general MDPs: environments, group rollouts, advantages and datum assembly, for the training loop.

One RL step, as the loop calls it:

    builders = train.get_batch(step)                                    # envs.build_datasets(cfg.env, ctx)
    batch = await rollout_batch(builders, sampler, params, seed=seed, step=step, max_context=...)  # rollouts
    groups = remove_constant_reward_groups(batch.groups)                # advantages (optional)
    advantages_P_G = compute_advantages(groups, normalize_std)          # advantages
    data_D, sources_D = assemble_datums(groups, advantages_P_G)        # datums
    data_D, kl_metrics = apply_kl_penalty(data_D, await reference_logprobs(ref, data_D), coef)  # kl (optional)
    metrics = trajectory_metrics(groups) | batch.error_metrics()        # metrics
    write_html(...), write_rollout_summaries(...)                       # transcripts

This package is the RL library; the RL algorithm that the loop runs is runner/algos/rl.py RLAlgo (sync / stream /
async modes, evals, transcripts, resume state).

Modules: types (Env, StepResult, Transition, Trajectory, TrajectoryGroup, EnvGroupBuilder, RLDataset),
envs/ (built-in envs and the python escape hatch), rollouts, advantages,
datums, kl, metrics, transcripts, testing (a scripted sampler); envs speak messages through runner/renderers/chat.py
ChatRenderer; the recipe section is in runner/recipe/schema.py
(schema re-exports it).
"""
