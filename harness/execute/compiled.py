"""Any stage plan under ``torch.compile`` (``run_cell(..., compile=True)``, ``compile=true`` in Hydra).

NOTE [compiling a plan]
Under ``torch.compile`` the saved-tensor hooks of the executor (NOTE [executing a plan]) never run: the
compiler's partitioner decides, on the joint forward-backward graph, which values the forward graph hands
the backward one and which the backward recomputes. It honours a per-op policy, the one selective
activation checkpointing sets (``node.meta["recompute"]``): ``MUST_RECOMPUTE`` is never saved, ``MUST_SAVE``
never recomputed. So a plan is compiled by telling the partitioner, op by op, which IR node the op computes:

- ``marked_module`` copies the traced fx module and puts ``recompute_bench::mark(value, node)`` after the
  last writer of each IR node (NOTE [nodes are storages]); every later reader reads the mark's result, also
  one that names an earlier member returning the same tensor (code reads ``y`` after ``y[i] = 0``:
  ``Traced.same_tensor``; an unread mark is dropped, and its node's ops would go to the next node's).
  After the last writer nothing writes the storage again, so a reader sees the same value either way.
- ``tag_plan`` runs on the joint graph, before the partitioner: the ATen ops traced up to a mark belong to
  its IR node (a view belongs to the node it views). An op of a recomputed node is ``MUST_RECOMPUTE``; the
  value of a kept node is ``MUST_SAVE``. The other ops of a kept node (batch norm's centred input, say)
  are left to the partitioner, which saves them or recomputes them from saved values as it would without
  a plan. The marks are then removed: each is its input.

The partitioner then reorders the backward so that each recomputation runs just before its first use, as
the autograd engine does (``reordering_to_mimic_autograd_engine``), and replays a recomputed random op from
the RNG state it saved. Inductor fuses what is recomputed with the backward ops that read it: the plan's
memory at the compiler's speed.

Backends as for the compile peer (below): inductor on cuda (the tagging is its ``joint_custom_pre_pass``),
``aot_eager_decomp_partition``'s pipeline on cpu, and on meta an AOT replay of the partitioned graphs.

NOTE [written inputs under compile]
A step that writes a buffer (BatchNorm's running statistics, spectral normalisation's ``_u`` and ``_v``, a
counter or an EMA written outside a layer) writes the graph's input: a ``copy_`` into it at the end of the
forward graph (``keep_inference_input_mutations``, as inductor compiles; the cpu and meta pipelines ask for
it too). An op that reads the input before the write and that the partitioner recomputes in the backward
would read it after the write: AOTAutograd stops ("modified by an inplace operation") where it sees the
saved input, and would compute from the new state where it did not. So ``tag_plan`` makes every op that
reads a written input (through views) ``MUST_SAVE``: never recomputed, and saved only where the backward
needs it (a spectral norm's first products; BatchNorm's update of its statistics is read by nothing
there). pytorch/pytorch#197039 proposes the same in the partitioner itself.

NOTE [graph breaks]
Where dynamo cannot trace a call (a reentrant ``checkpoint``, a draw from a ``torch.Generator`` of the
model's own), it runs the call eagerly and compiles the program as several graphs, and each graph is
partitioned alone: a value that one graph hands the next is an input there, which the partitioner cannot
recompute. A plan that recomputes such a value is refused, naming it (``AcrossGraphs``, raised by
``tag_plan`` and turned into ``Inapplicable`` by ``plan_step``: an ``infeasible`` row); a plan that keeps
it compiles. The replay on meta compiles one graph (``fullgraph=True``), so there a graph break refuses
the step whatever the plan.

NOTE [measuring torch.compile]
The tracker is a dispatch mode, and torch.compile runs a frame eagerly while a dispatch mode is active,
so on ``meta`` the compiled program is replayed instead: ``torch.compile`` with AOTAutograd (the
partitioner and decompositions inductor uses, in one graph) compiles the step once, its forward and
backward graphs are kept, and each step runs them op by op under ``no_grad`` (the tracker sees every op),
the loss and its gradient eagerly between them; each value, saved ones included, is freed after its last
use in its graph, as inductor's generated code does. That compile, on meta, is ``compile_time_s``. On ``cpu``
and ``cuda`` the step is the real ``torch.compile`` (``aot_eager_decomp_partition`` on cpu, inductor on
cuda), compiled by a first step outside any dispatch mode (``compile_time_s``: dynamo runs a frame first met
under the tracker eagerly and never compiles it after). The cuda allocator measures it, with no tracker
(``tracker_peak_bytes`` is empty), while on cpu nothing can: a compiled row there has step times only
(``measure(..., compiled=True)``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import time

import torch
import torch.fx as fx
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.checkpoint import CheckpointPolicy

from harness.measure import MemoryTracker, clear_grads
from harness.tracing.state import generators_of, state_kept
from harness.tracing.traced import Traced
from strategies import Inapplicable, Plan


@torch.library.custom_op("recompute_bench::mark", mutates_args=())
def mark(value: torch.Tensor, node: int) -> torch.Tensor:
    """The value of IR node ``node``; only ever traced (``tag_plan`` removes it before anything runs)."""
    return value.clone()


@mark.register_fake
def _(value, node):
    return torch.empty_like(value)


def _mark_backward(ctx, grad):
    return grad, None


mark.register_autograd(_mark_backward)
MARK = torch.ops.recompute_bench.mark.default


def marked_module(traced: Traced) -> fx.GraphModule:
    """``traced.module`` with a mark after each IR node's last writer (NOTE [compiling a plan]); it shares
    the module's parameters and buffers."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    last_writer = {name: v for v, name in enumerate(traced.graph.names)}  # an IR node is named after it
    same_tensor: dict[str, list[fx.Node]] = {}  # last writer -> the earlier members that return its tensor
    for node in traced.module.graph.nodes:
        if node.name in traced.same_tensor:
            same_tensor.setdefault(traced.graph.names[traced.same_tensor[node.name]], []).append(node)
    grad_on = True
    for node in traced.module.graph.nodes:
        if node.meta.get("no_grad", False) == grad_on:  # the model's grad mode changes (NOTE [grad mode] in trace.py)
            grad_on = not grad_on
            graph.call_function(torch._C._set_grad_enabled, (grad_on,))
        copied = graph.node_copy(node, lambda n: env[n])
        if node.name in last_writer:
            # The mark is the value itself, with grad on: a write under no_grad (a clamp_ of a copy, NOTE [a
            # write after a read] in trace.py) leaves the value's gradient passing it by, as in the model.
            if not grad_on:
                graph.call_function(torch._C._set_grad_enabled, (True,))
            copied = graph.call_function(_mark_tensors, (copied, last_writer[node.name]))
            if not grad_on:
                graph.call_function(torch._C._set_grad_enabled, (False,))
            # Code reads a written value by the name of the layer that made it (``x[i] = y`` and ``h.relu_()``
            # return nothing it keeps): those reads take the mark too, else dynamo drops the mark as unused,
            # and tag_plan gives the node's ops to the next node's mark.
            for member in same_tensor.get(node.name, ()):
                env[member] = copied
        env[node] = copied
    return fx.GraphModule(traced.module, graph)


def _mark_tensors(value, node: int):
    """``mark`` on a tensor, or on each tensor of a tuple or list (a layer that returns several)."""
    if isinstance(value, torch.Tensor):
        return MARK(value, node)
    if isinstance(value, (tuple, list)):
        return type(value)([MARK(t, node) if isinstance(t, torch.Tensor) else t for t in value])
    return value


def tag_plan(graph: fx.Graph, recomputed: int) -> None:
    """Tag the ops of a joint graph with the plan's policy and take the marks out (NOTE [compiling a plan]).
    ``recomputed`` is the plan's bitset of recomputed IR nodes."""
    marks = [node for node in graph.nodes if node.target is MARK]
    if not marks:
        return
    node_of: dict[fx.Node, int] = {}
    pending: list[fx.Node] = []
    for node in graph.nodes:
        if node is marks[-1].next:
            break
        if node.op != "call_function":
            continue
        if node.target is MARK:
            v = node.args[1]
            for op in pending:
                node_of[op] = v
            pending = []
            node_of[node] = v
            source = node.args[0]
            recompute = recomputed >> v & 1
            if recompute and source.op == "placeholder":
                raise AcrossGraphs(v)
            source.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE if recompute else CheckpointPolicy.MUST_SAVE
        elif _is_view(node) and node.args and node.args[0] in node_of:
            node_of[node] = node_of[node.args[0]]
        else:
            pending.append(node)
    for op, v in node_of.items():
        if recomputed >> v & 1:
            op.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    for op in _reads_of_written_inputs(graph):
        op.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    for node in marks:
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)


def _reads_of_written_inputs(graph: fx.Graph) -> list[fx.Node]:
    """The ops that read a graph input the step writes (a ``copy_`` into it: a buffer), through views
    (NOTE [written inputs under compile])."""
    written = [n.args[0] for n in graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)
               if n.args[0].op == "placeholder"]
    reads, seen = [], set(written)
    while written:
        node = written.pop()
        for user in node.users:
            if user in seen or (user.target is torch.ops.aten.copy_.default and user.args[0] is node):
                continue
            seen.add(user)
            (written if _is_view(user) else reads).append(user)
    return reads


class AcrossGraphs(Exception):
    """A recomputed IR node whose value reaches this graph as an input: dynamo broke the program into
    graphs there (NOTE [graph breaks])."""

    def __init__(self, node: int):
        super().__init__(f"IR node {node} is an input of the graph")
        self.node = node


def _is_view(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.is_view


class PlanPass:
    """``tag_plan`` as inductor's ``joint_custom_pre_pass`` (with the ``uuid`` its cache asks for)."""

    def __init__(self, recomputed: int):
        self.recomputed = recomputed

    def __call__(self, graph: fx.Graph) -> None:
        tag_plan(graph, self.recomputed)

    def uuid(self) -> bytes:
        return hashlib.sha256(f"recompute_bench.tag_plan:{self.recomputed}".encode()).digest()


def plan_backend(device_type: str, recomputed: int):
    """A ``torch.compile`` backend that tells the partitioner the plan's ``recomputed`` nodes, for the user's own
    compiled step over ``marked_module`` (``harness.train``): inductor with the plan as its joint graph's
    pre-pass on cuda, ``aot_eager_decomp_partition``'s pipeline with the plan's partition elsewhere, as
    ``compiled_step`` compiles a cell's step."""
    from torch._inductor.compile_fx import compile_fx
    import torch._inductor.config as inductor_config

    if device_type == "cuda":
        def inductor_with_plan(module, example_inputs):
            with inductor_config.patch(joint_custom_pre_pass=PlanPass(recomputed)):
                return compile_fx(module, example_inputs)
        return inductor_with_plan
    return _aot_eager(_partition(recomputed))


def _partition(recomputed: int | None):
    """The partitioner's min-cut, told the plan's ``recomputed`` nodes where there is a plan."""
    from functorch.compile import min_cut_rematerialization_partition

    partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    return partition if recomputed is None else functools.partial(_tagged_partition, partition, recomputed)


def _aot_eager(partition):
    """``aot_eager_decomp_partition``'s pipeline with ``partition`` (the cpu backend of a compiled step)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor.compile_fx import select_decomp_table

    return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, decompositions=select_decomp_table,
                        partition_fn=partition, keep_inference_input_mutations=True)


def plan_step(traced: Traced, plan: Plan, example_input: torch.Tensor, loss_fn):
    """The training step of ``plan`` under ``torch.compile`` (NOTE [compiling a plan]); the returned
    function has ``compile_time_s``."""
    import torch._dynamo  # NOTE [imported where used] in harness/zoo/nets.py

    try:
        return compiled_step(marked_module(traced), traced.module, example_input, loss_fn, recomputed=plan.recomputed)
    except torch._dynamo.exc.BackendCompilerFailed as error:
        if not isinstance(error.inner_exception, AcrossGraphs):
            raise
        name = traced.graph.names[error.inner_exception.node]
        raise Inapplicable(
            f"{plan.strategy} under compile=true: it recomputes {name}, whose value dynamo hands from one compiled "
            "graph to the next (a graph break: a call dynamo runs eagerly, such as a reentrant checkpoint or a draw "
            "from a torch.Generator of the model's own), and the partitioner recomputes only within a graph; run "
            "it with compile=false, or with a plan that keeps that value") from None


def compiled_step(forward, model: nn.Module, example_input: torch.Tensor, loss_fn, budget_ratio: float = 1.0,
                  recomputed: int | None = None, context=contextlib.nullcontext):
    """The training step of ``forward`` (``model`` or a function that calls it) under ``torch.compile``:
    with ``activation_memory_budget=budget_ratio``, or with the partitioner told the plan's ``recomputed``
    nodes (``forward`` from ``marked_module``). ``context()`` is entered around every call (a peer's
    checkpoints). Off meta, the first step runs here, outside any dispatch mode (NOTE [measuring
    torch.compile]); the returned function has ``compile_time_s``."""
    import torch._dynamo  # NOTE [imported where used] in harness/zoo/nets.py
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    patches = [functorch_config.patch(activation_memory_budget=budget_ratio)]
    partition = _partition(recomputed)
    # Each cell compiles anew: dynamo's cache would otherwise fill with earlier cells' models (one entry per
    # instance) and, past its size limit, run later ones eagerly without a word.
    torch._dynamo.reset()
    device = example_input.device.type
    if device == "meta":
        return _replayed_step(forward, model, example_input, loss_fn, patches, partition, context)
    if _get_current_dispatch_mode() is not None:
        raise RuntimeError("compiled_step: build the step outside any dispatch mode, or dynamo will not compile it")
    if device == "cuda":
        backend = "inductor"
        if recomputed is not None:
            patches.append(inductor_config.patch(joint_custom_pre_pass=PlanPass(recomputed)))
    else:
        backend = _aot_eager(partition)
    compiled = torch.compile(forward, backend=backend)

    def run():
        with _patched(patches), context():  # every call: a recompile must see them too
            loss = loss_fn(compiled(example_input))
            loss.backward()
        return loss.detach()

    # The compiling step must not count as a step: its buffer writes and its draws are undone.
    programs = [model, forward] if isinstance(forward, nn.Module) else [model]  # forward: a module or a function
    rng = ({example_input.device}, [g for program in programs for g in generators_of(program)])
    with state_kept(model, rng):
        start = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        run.compile_time_s = time.perf_counter() - start
    clear_grads(model)
    return run


@contextlib.contextmanager
def _patched(patches):
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def _tagged_partition(partition, recomputed: int, joint: fx.GraphModule, joint_inputs, **kwargs):
    tag_plan(joint.graph, recomputed)
    joint.recompile()
    return partition(joint, joint_inputs, **kwargs)


def _replayed_step(forward, model, example_input, loss_fn, patches, partition, context):
    """On meta: compile once, keeping AOTAutograd's forward and backward graphs, and replay them op by op
    (NOTE [measuring torch.compile])."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import select_decomp_table

    graphs, arguments = {}, []

    def keep(kind):
        def compiler(graph_module, example_inputs):
            graphs[kind] = graph_module

            def call(args):
                if kind == "forward" and not arguments:
                    arguments.extend(args)  # parameters, buffers, input: the order the graph takes them
                return _Replay(graph_module).boxed_run(args)

            call._boxed_call = True  # AOTAutograd passes the arguments as one list
            return call
        return compiler

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                           decompositions=select_decomp_table, partition_fn=partition,
                           keep_inference_input_mutations=True)
    start = time.perf_counter()
    # On meta a tensor the program makes without naming a device is made on meta (NOTE [random draws on
    # constants] in trace.py); fullgraph: the replay runs one forward and one backward graph.
    with _patched(patches), context(), torch.device("meta"):
        try:
            loss_fn(torch.compile(forward, backend=backend, fullgraph=True)(example_input)).backward()
        except torch._dynamo.exc.Unsupported as error:  # a graph break (NOTE [graph breaks])
            raise Inapplicable(
                "compile=true on meta replays the step's one forward and one backward graph, and dynamo breaks "
                f"this program into several ({str(error).splitlines()[0]}); measure it on cpu or cuda, or run "
                "it with compile=false") from None
    compile_time_s = time.perf_counter() - start
    clear_grads(model)
    placeholders = [n.name for n in graphs["backward"].graph.find_nodes(op="placeholder")]
    saved_count = sum(1 for name in placeholders if not name.startswith("tangents"))

    def run():
        # The forward graph writes the buffers it updates (NOTE [written inputs under compile]) and returns
        # the model's output, then what the backward graph takes before the output's gradient.
        with torch.no_grad():
            outputs = _Replay(graphs["forward"]).run(*arguments)
        saved = list(outputs[len(outputs) - saved_count:])
        handed = []  # the output's gradient, as the loss's backward hands it to the compiled backward
        output = _HandOff.apply(torch.empty(0, requires_grad=True), outputs[len(outputs) - saved_count - 1],
                                handed)
        del outputs
        loss = loss_fn(output)
        del output  # as in the compiled step: what holds the output now is what the loss saved
        loss.backward()
        loss = loss.detach()  # its graph, which the backward graph's run must not keep
        backward_arguments = saved + [handed.pop()]  # the list lives on in the graph's node
        del saved
        with torch.no_grad():  # boxed: the interpreter holds the only references and frees each after use
            grads = _Replay(graphs["backward"]).boxed_run(backward_arguments)
        tracker = _get_current_dispatch_mode()
        for argument, grad in zip(arguments, grads):
            if isinstance(argument, nn.Parameter) and grad is not None:
                argument.grad = grad
                if isinstance(tracker, MemoryTracker):
                    tracker.mark_grad(argument)
        return loss

    run.compile_time_s = compile_time_s
    return run


class _HandOff(torch.autograd.Function):
    """The forward graph's output as the loss reads it, whose gradient goes into ``handed``. The compiled
    step holds its output only while the loss's graph does and the output's gradient only until the
    backward graph's last use of it; a leaf would be held by its gradient's accumulator (and
    ``autograd.grad``'s argument by the caller) through the backward graph, one output more."""

    @staticmethod
    def forward(ctx, anchor, output, handed):
        ctx.handed = handed
        return output.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.handed.append(grad)
        return None, None, None


class _Replay(fx.Interpreter):
    """Runs a partitioned graph on meta. A recomputed random op comes wrapped in the RNG-state operators
    (``run_and_save_rng_state`` in the forward graph, ``run_with_rng_state`` in the backward one); meta has
    no RNG state, so the op runs bare and the saved state is an empty tensor."""

    def call_function(self, target, args, kwargs):
        from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

        if target is run_and_save_rng_state:
            op, *rest = args
            return torch.empty(0, dtype=torch.uint8, device="meta"), op(*rest, **kwargs)
        if target is run_with_rng_state:
            _, op, *rest = args
            return op(*rest, **kwargs)
        return super().call_function(target, args, kwargs)
