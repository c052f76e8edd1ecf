"""The adaptive policy on ordinary variations of a training loop: what compiles after warm-up, how
many compiles it takes, and that every result still equals CPU."""
import copy

import pytest
import torch

import tilewise

WARMUP, MEASURED = 6, 10


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def _train_reading_loss_first(model, optimizer, x, y, steps, device):
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        losses.append(loss.item())  # read before backward(): the step is cut in two segments
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_reading_the_loss_before_backward_compiles_the_whole_step(mode, opt):
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    cpu_model = _mlp()
    device_model = copy.deepcopy(cpu_model).to("neuron")
    cpu_opt, device_opt = _optimizer(opt, cpu_model.parameters()), _optimizer(opt, device_model.parameters())
    expected = _train_reading_loss_first(cpu_model, cpu_opt, x, y, WARMUP + MEASURED, "cpu")
    with tilewise.engine(mode=mode):
        got = _train_reading_loss_first(device_model, device_opt, x, y, WARMUP, "neuron")
        tilewise.stats().reset()
        got += _train_reading_loss_first(device_model, device_opt, x, y, MEASURED, "neuron")
    stats = tilewise.stats()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    for p, q in zip(device_model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)
    assert stats.compiled_fraction >= 0.95, stats.report()
    assert stats.ops_compiled > 0 and stats.cache_hits >= MEASURED


def _cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))


def _train_with_schedule(model, x, y, steps, device, foreach, reset_at=None, on_reset=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=foreach)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    losses = []
    for step in range(steps):
        if step == reset_at:
            on_reset()
            tilewise.stats().reset()
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for-loop"])
@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
def test_a_learning_rate_schedule_compiles_once_its_rate_has_changed(mode, foreach):
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    cpu_model = _cnn()
    device_model = copy.deepcopy(cpu_model).to("neuron")
    steps, measured_from = 24, 12
    expected = _train_with_schedule(cpu_model, x, y, steps, "cpu", foreach)
    compiles_before = {}
    with tilewise.engine(mode=mode):
        got = _train_with_schedule(device_model, x, y, steps, "neuron", foreach, reset_at=measured_from,
                                   on_reset=lambda: compiles_before.update(vars(tilewise.stats())))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    for p, q in zip(device_model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)
    warmup_regions = compiles_before["regions"].values()
    hit = [r for r in warmup_regions if r.hits]
    assert hit and compiles_before["compiles"] <= 2 * len(hit), compiles_before["regions"]
    measured = tilewise.stats()
    assert measured.compiled_fraction >= 0.95 and measured.compiles == 0, measured.report()


aten = torch.ops.aten


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["tensor_arg", "scalar_overload", "alpha", "foreach_alpha", "pow", "lerp",
                                "foreach_lerp", "addcdiv_value", "addcmul_value", "full", "foreach_addcdiv_value"])
def test_each_way_a_changing_float_enters_a_region_equals_cpu(op, dtype):
    def program(x, w, s):
        if op == "foreach_addcdiv_value":  # RMSprop's update under a schedule: value=-lr, packed as `scalars`
            a, b = x * 1, w * 1
            torch._foreach_addcdiv_([a, b], [w, x], [x, w], -s / 5)
            return a, b
        if op == "full":  # a tensor made every step, filled with a number that changes (a noise level)
            return (x + torch.full((8, 1), s / 3, dtype=dtype, device=x.device),)
        if op == "tensor_arg":
            return (x * s + 1,)
        if op == "scalar_overload":
            return (aten.add.Scalar(x, s) * 2,)
        if op == "alpha":
            return (torch.add(x, w, alpha=s).relu(),)
        if op == "foreach_alpha":
            return tuple(torch._foreach_add([x, w], [w, x], alpha=s))
        if op == "pow":
            return (x.abs().pow(s),)
        if op == "addcdiv_value":  # Adam's per-parameter update: value=-step_size, new every step
            return (x.clone().addcdiv_(w, x.abs() + 1, value=-s / 3),)
        if op == "addcmul_value":
            return (torch.addcmul(x, w, x, value=s / 7) * 2,)
        if op == "foreach_lerp":
            a, b = x * 1, w * 1
            torch._foreach_lerp_([a, b], [w, x], s / 8)
            return a, b
        return (torch.lerp(x, w, s),)

    x_cpu, w_cpu = torch.randn(8, 8, dtype=dtype), torch.randn(8, 8, dtype=dtype)
    x, w = x_cpu.to("neuron"), w_cpu.to("neuron")
    with tilewise.engine(mode="adaptive", threshold=2):
        for step in range(8):
            s = 0.5 + 0.25 * step
            got = [t.cpu() for t in program(x, w, s)]
            for value, want in zip(got, program(x_cpu, w_cpu, s)):
                assert value.dtype == want.dtype
                assert torch.equal(value, want), (step, (value.double() - want.double()).abs().max())  # bitwise
    stats = tilewise.stats()
    if op in ("alpha", "foreach_alpha", "foreach_lerp", "addcdiv_value", "addcmul_value") and dtype == torch.bfloat16 \
            or op == "pow":
        # In 16 bits addcmul rounds a 0-dim alpha to bfloat16 where CPU's add keeps it in float32
        # (and a product by value to bfloat16 where the kernel keeps value * t1 in float32),
        # and _foreach_lerp's List kernel rounds its weight otherwise than its Scalar kernel; pow by
        # a number special-cases exponents (2 is x * x, 0.5 sqrt) that pow by a tensor does not. So
        # the float stays a constant, the op eager while it changes
        dynamic = {name for name, reason in stats.fallbacks if reason.startswith("dynamic")}
        assert {"foreach_lerp": "_foreach_lerp_", "foreach_alpha": "_foreach_add", "alpha": "add",
                "pow": "pow", "addcdiv_value": "addcdiv_", "addcmul_value": "addcmul"}[op] in dynamic, stats.report()
        return
    assert stats.compiles >= 1 and stats.cache_hits >= 3, stats.report()
    assert stats.compiles <= 2, stats.report()
    assert not [name for name, reason in stats.fallbacks if reason.startswith("dynamic")], stats.report()


def test_a_cycle_of_lengths_compiles_each_length_once_it_recurs():
    from tilewise.workloads import train_seq

    reference = train_seq("cpu", None, steps=40)
    tilewise.stats().reset()
    result = train_seq("neuron", "adaptive", steps=40, on_step=lambda step: step == 24 and tilewise.stats().reset())
    torch.testing.assert_close(result[0], reference[0], rtol=1e-4, atol=1e-5)
    stats = tilewise.stats()  # steps 25-40: every length has recurred `threshold` times
    assert stats.compiled_fraction >= 0.95 and stats.compiles == 0, stats.report()


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
def test_a_loss_scaled_by_a_changing_float_compiles_and_keeps_its_dtype(mode):
    """The scale multiplies a 0-dim loss: as a number it keeps float32, as a float64 0-dim tensor
    it would promote the backward to float64, so that float stays a constant (the rest compiles)."""
    torch.manual_seed(0)
    cpu_model = torch.nn.Linear(16, 4)
    device_model = copy.deepcopy(cpu_model).to("neuron")
    x = torch.randn(8, 16)
    losses = []
    for model, device in ((cpu_model, "cpu"), (device_model, "neuron")):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        run = []
        with tilewise.engine(mode=mode):
            for step in range(12):
                loss = model(x.to(device)).pow(2).mean() * (1.0 + step * 1e-2)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                run.append(loss.item())
                assert loss.dtype == torch.float32
        losses.append(run)
    torch.testing.assert_close(losses[1], losses[0])
    stats = tilewise.stats()
    assert stats.compiles >= 1 and stats.compiled_fraction > 0.5, stats.report()
    assert not [r for (_, r) in stats.fallbacks if r.startswith("compile failed")], stats.report()


def test_stats_and_the_explorer_read_one_event_stream():
    """Compiles reach stats() through the same typed events the explorer subscribes to."""
    from tilewise.adaptive import RUNTIME
    from tilewise.adaptive.events import RegionCompiled, SegmentRan

    seen = []
    RUNTIME.events.subscribe(RegionCompiled, seen.append)
    RUNTIME.events.subscribe(SegmentRan, seen.append)
    try:
        tilewise.reset_caches()
        tilewise.stats().reset()
        x_cpu = torch.randn(8, 8)
        x = x_cpu.to("neuron")
        with tilewise.engine(mode="compiled"):
            got = [(x.sin() * 2 + 1).cpu() for _ in range(3)]
    finally:
        RUNTIME.events.unsubscribe(RegionCompiled, seen.append)
        RUNTIME.events.unsubscribe(SegmentRan, seen.append)
    for value in got:
        torch.testing.assert_close(value, x_cpu.sin() * 2 + 1)
    compiled = [e for e in seen if isinstance(e, RegionCompiled)]
    segments = [e for e in seen if isinstance(e, SegmentRan)]
    stats = tilewise.stats()
    assert compiled and stats.compiles == len(compiled)
    assert [e.region for e in compiled] == list(stats.regions)
    assert stats.compile_seconds == pytest.approx(sum(e.seconds for e in compiled))
    assert len(segments) == stats.segments == 3 and segments[-1].replayed
    assert stats.unused_compiles == 0 and stats.cache_hits == 2


def _fit_one_cycle(device, mode, steps):
    """Adam under OneCycleLR (its momentum cycle changes Adam's beta1, a _foreach_lerp_ weight,
    every step), two micro-batches of gradient accumulation, clip_grad_norm_, an EMA of the weights
    and a validation pass of the EMA model under no_grad every fifth step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                                torch.nn.Linear(32, 4)).to(device)
    ema = copy.deepcopy(model)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=steps)
    losses, compiles_before = [], None
    with tilewise.engine(mode=mode):
        for step in range(steps):
            if step == steps // 2:
                compiles_before = tilewise.stats().compiles
                tilewise.stats().reset()
            for half in (slice(0, 32), slice(32, 64)):
                loss = torch.nn.functional.cross_entropy(model(x[half].to(device)), y[half].to(device)) / 2
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            with torch.no_grad():
                torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 0.1)
            losses.append(loss.item())
            if step % 5 == 4:
                with torch.no_grad():
                    losses.append(torch.nn.functional.cross_entropy(ema(x.to(device)), y.to(device)).item())
    return losses, compiles_before


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
def test_one_cycle_adam_with_accumulation_clipping_and_ema_compiles(mode):
    expected, _ = _fit_one_cycle("cpu", None, 30)
    tilewise.reset_caches()
    tilewise.stats().reset()
    got, compiles_before = _fit_one_cycle("neuron", mode, 30)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    stats = tilewise.stats()  # the second half of the run
    assert compiles_before <= 6 and stats.compiles == 0, stats.report()
    assert stats.compiled_fraction >= 0.9, stats.report()


def _trained_on_cpu_and_neuron(make_optimizer, mode: str, make_schedule=None) -> tuple[list, list]:
    """(neuron's parameters, CPU's) after 12 steps of a small MLP, with the optimizer (and its
    schedule), under deterministic algorithms (regions on their recorded graphs: bitwise)."""
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    device_model = copy.deepcopy(cpu_model).to("neuron")

    def train(model, device):
        opt = make_optimizer(model.parameters())
        schedule = make_schedule(opt) if make_schedule else None
        generator = torch.Generator().manual_seed(1)
        for _ in range(12):
            model(torch.randn(5, 6, generator=generator).to(device)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if schedule is not None:
                schedule.step()
            tilewise.sync()
        return [p.detach().cpu() for p in model.parameters()]

    torch.use_deterministic_algorithms(True)
    try:
        expected = train(cpu_model, "cpu")
        with tilewise.engine(mode=mode):
            got = train(device_model, "neuron")
    finally:
        torch.use_deterministic_algorithms(False)
    return got, expected


_STEPPED = {"SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            # its update reads values computed with constant floats (rho, eps): not a changing float
            "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0)}


def _eager_ops_per_step(make_optimizer, steps: int, schedule_every: int) -> list[int]:
    """The eager ops of each adaptive step of a linear model, its learning rate halved by a StepLR
    schedule every `schedule_every` steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to("neuron")
    opt = make_optimizer(model.parameters())
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=schedule_every, gamma=0.5)
    counts = []
    with tilewise.engine(mode="adaptive"):
        for _ in range(steps):
            before = tilewise.stats().ops_eager
            model(torch.randn(3, 4).to("neuron")).pow(2).mean().backward()
            opt.step()
            schedule.step()
            opt.zero_grad()
            tilewise.sync()
            counts.append(tilewise.stats().ops_eager - before)
    return counts


@pytest.mark.parametrize("optimizer", sorted(_STEPPED))
def test_a_float_that_first_changes_after_the_step_has_compiled_compiles_again(optimizer):
    """StepLR keeps the rate for 8 steps, then halves it: the update's alpha enters the region as a
    tensor from then on. The flush where it first changed made a plan for a segment whose floats
    change (its update eager), cached for every later value: the update ran eagerly for the rest
    of training (one op a step here, every parameter's update in a larger model)."""
    counts = _eager_ops_per_step(_STEPPED[optimizer], steps=24, schedule_every=8)
    assert all(count > 0 for count in counts[:3])  # warming up
    assert sum(counts[3:8]) == 0 and sum(counts[12:]) == 0, counts
    got, expected = _trained_on_cpu_and_neuron(_STEPPED[optimizer], "adaptive",
                                               lambda opt: torch.optim.lr_scheduler.StepLR(opt, 4, 0.5))
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_the_same_ops_in_another_dtype_with_changing_floats_compile():
    """A second loop of the same ops (here in float64) met a segment skeleton seen many times: its
    first flush, floats still constants, was planned as changing constants and that plan served
    every later flush, after the floats had become region inputs."""
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(2, 3, dtype=dtype)
        tilewise.stats().reset()
        with tilewise.engine(mode="adaptive"):
            xn = x.to("neuron")
            for step in range(12):
                scale = step / 7 + 0.01 * step * step
                assert torch.equal(((xn * scale) + 1).sum(1).cpu(), ((x * scale) + 1).sum(1))
        stats = tilewise.stats()
        assert stats.ops_compiled >= 27 and stats.ops_eager <= 9, (dtype, stats.report())


def test_an_update_whose_tensor_twin_packs_its_scalars_compiles_under_a_schedule():
    """RMSprop's update is `_foreach_addcdiv_(params, grads, avg, value=-lr)`; a scheduled lr entered
    as the Tensor overload's `scalars` 0-dim, which CPU's kernel refuses (one per tensor, 1-d): the
    step's region failed to compile at every flush and the whole step ran eagerly."""
    got, expected = _trained_on_cpu_and_neuron(lambda p: torch.optim.RMSprop(p, lr=1e-2), "adaptive",
                                               lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, 0.9))
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    stats = tilewise.stats()
    assert not [key for key in stats.fallbacks if "compile failed" in key[1]], stats.report()
    assert stats.compiled_fraction > 0.5, stats.report()


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
@pytest.mark.parametrize("optimizer", ["Adam for-loop", "NAdam"])
def test_per_parameter_adam_steps_compile_their_changing_step_sizes(optimizer, mode):
    """The per-parameter Adam and NAdam (NAdam's loop is neuron's default, as CPU's) give addcdiv_ a
    new `value` every step (the bias-corrected step size): it enters the region as a tensor, so the
    whole step compiles (it ran eagerly every step, and compiled mode hit its recompile limit)."""
    make = {"Adam for-loop": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False),
            "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2)}[optimizer]
    got, expected = _trained_on_cpu_and_neuron(make, mode)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    stats = tilewise.stats()
    assert not stats.fallbacks, stats.report()
    if mode == "compiled":
        assert stats.ops_compiled > 0 and stats.ops_eager == 0, stats.report()


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
@pytest.mark.parametrize("optimizer", ["AdamW", "SGD", "Adagrad"])
def test_a_scheduled_learning_rate_of_a_fused_optimizer_enters_the_region_as_a_tensor(optimizer, mode):
    """`fused=True` with a schedule: the fused op's float `lr` changes every step. It is recorded
    as the op's tensor_lr overload from the first step (CPU's kernels read it as a double: same
    values), so the step compiles once (the op ran eagerly every step)."""
    make = {"AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
            "SGD": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, fused=True),
            "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2, fused=True)}[optimizer]

    def warm_up_then_cosine(opt):
        # the rate alone changes (OneCycleLR cycles the momentum too, beta1 or SGD's momentum,
        # which the fused ops take as floats only: the op stays eager meanwhile)
        return torch.optim.lr_scheduler.SequentialLR(opt, [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)], milestones=[4])

    got, expected = _trained_on_cpu_and_neuron(make, mode, warm_up_then_cosine)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    stats = tilewise.stats()
    assert not stats.fallbacks, stats.report()
    # the step's two regions (forward and backward; the optimizer's step, a segment of its own:
    # engine.py) compile once and serve the steps; what else compiled ran at the first step only
    # (the optimizer's state, made per parameter: 4)
    serving = [r for r in stats.regions.values() if r.hits >= 8]
    assert len(serving) == 2 and all(r.hits <= 4 for r in stats.regions.values() if r not in serving), stats.report()
    if mode == "compiled":
        assert stats.ops_compiled > 0 and stats.ops_eager == 0, stats.report()


def _sample(device: str, steps: int, on_step=lambda t: None) -> torch.Tensor:
    """A diffusion sampler's loop: its schedule read at each step's index (`betas[t]`, views taken
    outside the region at a new storage offset every step), the step read back each time."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(17, 32), torch.nn.SiLU(), torch.nn.Linear(32, 16)).to(device)
    betas = torch.linspace(1e-4, 0.02, steps, device=device)
    alphas = 1 - betas
    alphas_cumprod = torch.cumprod(alphas, 0)
    noise = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=noise).to(device)
    with torch.no_grad():
        for t in reversed(range(steps)):
            eps = model(torch.cat([x, torch.full((8, 1), t / steps, device=device)], 1))
            x = (x - betas[t] / torch.sqrt(1 - alphas_cumprod[t]) * eps) / torch.sqrt(alphas[t])
            x = x + torch.sqrt(betas[t]) * torch.randn(8, 16, generator=noise).to(device)
            x.abs().max().item()  # a check each step: one segment a step
            on_step(t)
    return x.cpu()


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
def test_a_sampler_reading_its_schedule_at_each_steps_index_compiles_once(mode):
    """The step's region takes `betas[t]` and its kin at new offsets each step: the same region
    wherever its inputs start, served by one compile (adaptive mode waited forever, compiled mode
    compiled each offset up to its recompile limit, then ran eagerly)."""
    torch.use_deterministic_algorithms(True)  # regions on their recorded graphs: bitwise
    counts = {}

    def count(t):
        stats = tilewise.stats()
        counts[t] = (stats.ops_eager, stats.ops_compiled, stats.compiles)

    try:
        expected = _sample("cpu", 30)
        with tilewise.engine(mode=mode):
            got = _sample("neuron", 30, on_step=count)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(got, expected)
    # steps 19 to 1 (at step 0 the views start at offset 0, which the shape-free form tells apart)
    eager, compiled, compiles = (after - before for after, before in zip(counts[1], counts[20]))
    assert eager == 0 and compiles == 0 and compiled > 0, tilewise.stats().report()


def test_a_region_whose_graph_reads_its_inputs_offsets_is_not_served_at_others():
    """Two views of one storage the region writes enter it as that storage, their views rebuilt
    inside at their offsets (regions.build_graph): such a compile is for its offsets only."""
    def run(device):
        buffer = torch.arange(64, dtype=torch.float32).to(device)
        views = [(buffer[t:t + 4], buffer[t + 20:t + 24]) for t in range(8)]
        sums = []
        for a, b in views:
            a.add_(a + b)
            b.mul_(2.0)
            sums.append(b.sum().item())
        return buffer.cpu(), sums

    expected = run("cpu")
    with tilewise.engine(mode="compiled"):
        got = run("neuron")
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]
    stats = tilewise.stats()
    assert stats.compiles >= 8 and stats.ops_compiled > 0, stats.report()


# -- the per-region state machine (policy.decide), one row per transition --------------------------
P = tilewise.adaptive.policy
A, J, W = P.Action, P.Job, None  # W: no reason
ADAPTIVE, COMPILED = P.Mode.ADAPTIVE, P.Mode.COMPILED
LIMITS = {"recompile_limit": 2, "generalise_limit": 2}
FAILED_BEFORE = P.Reason(P.Why.COMPILE_FAILED, "RuntimeError: boom")
MIXED = P.Reason(P.Why.MIXED_DTYPE_VIEWS)

# (state, mode, settling) -> (action, why)
TRANSITIONS = [
    # held for its key, or for its key at other input offsets: whatever the counts
    ((P.Compiled(None), ADAPTIVE, True), (A.RUN_COMPILED, W)),
    ((P.Compiled(None, at_other_offsets=True), COMPILED, False), (A.RUN_COMPILED, W)),
    ((P.Failed(FAILED_BEFORE), ADAPTIVE, False), (A.RUN_EAGER, P.Why.COMPILE_FAILED)),
    ((P.Failed(FAILED_BEFORE), COMPILED, False), (A.RUN_EAGER, P.Why.COMPILE_FAILED)),
    ((P.InFlight(None, J.RUNNING), ADAPTIVE, False), (A.AWAIT, W)),
    ((P.InFlight(None, J.DONE), ADAPTIVE, True), (A.TAKE_IN, W)),
    ((P.InFlight(None, J.LOST), ADAPTIVE, False), (A.COMPILE, W)),
    # nothing held, a form that cannot compile
    ((P.Unsupported(MIXED), COMPILED, False), (A.GIVE_UP, P.Why.MIXED_DTYPE_VIEWS)),
    # a miss, adaptive mode: compile once the segment settled or the region recurred
    ((P.Waiting(1, 1, False), ADAPTIVE, False), (A.COMPILE, W)),
    ((P.Waiting(1, 1, False), ADAPTIVE, True), (A.WAIT, P.Why.NOT_RECURRED)),
    ((P.Waiting(2, 1, False), ADAPTIVE, True), (A.COMPILE, W)),
    ((P.Waiting(5, 1, True), ADAPTIVE, False), (A.WAIT, P.Why.NOT_RECURRED)),  # its sizes change
    ((P.Waiting(1, 9, False), ADAPTIVE, False), (A.COMPILE, W)),  # no signature limit in adaptive mode
    # a miss, compiled mode: at first sight, up to recompile_limit + 1 signatures per site
    ((P.Waiting(1, 1, True), COMPILED, True), (A.COMPILE, W)),
    ((P.Waiting(1, 3, False), COMPILED, False), (A.COMPILE, W)),
    ((P.Waiting(1, 4, False), COMPILED, False), (A.REFUSE, P.Why.RECOMPILE_LIMIT)),
    # other sizes at its site
    ((P.Resized(J.RUNNING), ADAPTIVE, False), (A.AWAIT, W)),
    ((P.Resized(J.DONE), COMPILED, False), (A.TAKE_IN, W)),
    ((P.Resized(None, []), ADAPTIVE, True), (A.RUN_GENERIC, W)),
    ((P.Resized(None, None, 1, 2, False), ADAPTIVE, False), (A.REFUSE, P.Why.GENERALISE_LIMIT)),
    ((P.Resized(None, None, 1, 2, True), COMPILED, False), (A.REFUSE, P.Why.GENERALISE_LIMIT)),
    ((P.Resized(None, None, 1, 0, False), ADAPTIVE, True), (A.WAIT, P.Why.NOT_RECURRED)),
    ((P.Resized(None, None, 1, 0, True), ADAPTIVE, True), (A.WAIT, P.Why.NOT_RECURRED)),
    ((P.Resized(None, None, 2, 1, False), ADAPTIVE, True), (A.GENERALISE, W)),
    ((P.Resized(None, None, 1, 0, False), COMPILED, True), (A.GENERALISE, W)),
    ((P.Resized(None, None, 1, 0, False), ADAPTIVE, False), (A.GENERALISE, W)),
    ((P.Resized(None, None, 1, 0, True), ADAPTIVE, False), (A.REFUSE, P.Why.ZERO_ONE_SIZE)),
    ((P.Resized(None, None, 3, 1, True), COMPILED, True), (A.REFUSE, P.Why.ZERO_ONE_SIZE)),
]


@pytest.mark.parametrize("observed, expected", TRANSITIONS, ids=[f"{type(o[0]).__name__}-{o[1]}-{'settling' if o[2] else 'settled'}-{e[0].name}" for o, e in TRANSITIONS])
def test_the_region_policy_decides_each_state_as_its_table_says(observed, expected):
    state, mode, settling = observed
    decision = P.decide(state=state, mode=mode, settling=settling, **LIMITS)
    assert (decision.action, decision.reason and decision.reason.why) == expected
    if decision.action in (A.REFUSE, A.GIVE_UP):
        assert decision.reason is not None  # every refusal is counted with its reason


def test_the_region_policy_table_reaches_every_action_and_state():
    assert {expected[0] for _, expected in TRANSITIONS} == set(A)
    assert {type(observed[0]) for observed, _ in TRANSITIONS} == set(P.RegionState.__args__)
    with pytest.raises(TypeError):
        P.decide(P.Waiting(1, 1, False), ADAPTIVE, False, 2, 2)  # keyword-only


# -- a segment at a flush: dynamic, settling, how its plan is kept ---------------------------------
@pytest.mark.parametrize("dynamic, every_node_stable, block_ends, settling", [
    (False, False, False, True),   # neighbours warming up: a region may still grow
    (True, False, False, False),   # what is not stable keeps changing: nothing to wait for
    (False, True, False, False),   # settled
    (True, True, True, True), (False, True, True, True),  # the block's last segment: compile what recurs
])
def test_a_segment_settles_as_its_table_says(dynamic, every_node_stable, block_ends, settling):
    assert P.is_settling(dynamic=dynamic, every_node_stable=every_node_stable, block_ends=block_ends) is settling


def test_a_segment_is_dynamic_past_threshold_flushes_of_its_ops():
    assert not P.is_dynamic(skeleton_flushes=2, threshold=2) and P.is_dynamic(skeleton_flushes=3, threshold=2)


K = P.Kept


@pytest.mark.parametrize("stable, served, dynamic, compiling, floats, kept", [
    (True, True, False, True, False, K.FINAL),
    (True, True, True, True, False, K.FINAL),
    (True, False, True, True, True, K.NOT),          # a region waits, compiles or was refused
    (False, True, True, True, True, K.WHILE_FLOATS_CHANGE),
    (False, True, True, True, False, K.NOT),         # an eager node warming up
    (False, True, False, True, True, K.NOT),         # not dynamic: still warming up
    (False, True, True, False, True, K.NOT),         # eager mode
    (False, False, True, True, True, K.NOT),
])
def test_a_plan_is_kept_as_its_table_says(stable, served, dynamic, compiling, floats, kept):
    assert P.plan_kept(every_node_stable=stable, every_region_served=served, dynamic=dynamic,
                       compiling=compiling, eager_nodes_follow_floats=floats) is kept


def _recorded(memory, settings):
    """A segment of two recorded ops on device tensors, recorded with `memory`'s caches."""
    from tilewise.adaptive.segment import Segment

    x_cpu = torch.randn(6)
    x = x_cpu.to("neuron")
    segment = Segment()
    y = segment.record(aten.mul.Tensor, (x, x), {}, settings, memory.meta_cache, memory.scalar_sites)
    z = segment.record(aten.add.Scalar, (y, 1.0), {}, settings, memory.meta_cache, memory.scalar_sites)
    return segment, z, x_cpu * x_cpu + 1.0


def test_the_region_compiler_is_a_part_that_serves_regions_without_a_runtime():
    """A RegionCompiler given a memory of its own (no Runtime): a region settled at first sight
    compiles, runs as CPU computes, and is served from that memory when it comes again."""
    from tilewise.adaptive.compiling import RegionCompiler
    from tilewise.adaptive.events import EventStream
    from tilewise.adaptive.generic import GenericSites
    from tilewise.adaptive.memory import EngineMemory
    from tilewise.adaptive.regions import CompiledEntry, describe, needed_values
    from tilewise.adaptive.stats import Stats

    memory, stats, events = EngineMemory(), Stats(), EventStream()
    compiler = RegionCompiler(memory, stats, events, GenericSites(memory, stats, events))
    settings = P.Settings(ADAPTIVE, threshold=2, max_segment_ops=100)
    entries = []
    for _ in range(2):
        segment, z, want = _recorded(memory, settings)
        region = describe(segment, [0, 1], needed_values(segment, [[0, 1]]))
        entry = compiler.entry(segment, region, settling=False, sizes_change=False, before={})
        assert isinstance(entry, CompiledEntry)
        entry.run(segment, region)
        assert torch.equal(z.cpu(), want)
        entries.append(entry)
    assert entries[0] is entries[1] and stats.cache_misses == 1 and len(memory.regions) == 1
    assert tilewise.adaptive.RUNTIME.memory.cache_info()["regions"].entries == 0  # the engine's own memory is untouched
