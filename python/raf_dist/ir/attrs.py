"""IR attributes raf_dist sets on functions and TIR blocks, read by other layers."""

# train_step's attributes saying where parameters and optimizer states sit among its
# arguments: (inputs..., target, params..., states (per parameter, in order)..., scalars...)
LAYOUT_PARAM_OFFSET = "raf_dist.param_offset"  # index of the first parameter argument
LAYOUT_NUM_PARAMS = "raf_dist.num_params"
LAYOUT_STATES_PER_PARAM = "raf_dist.states_per_param"
# output field 1 + i of train_step is the new value of argument UPDATED_ARGUMENTS[i] (the
# parameters, then the optimizer states): compiler.UpdateInPlace makes the step write it into
# that argument's buffer
UPDATED_ARGUMENTS = "raf_dist.updated_arguments"
# the optimizer parameter group of each trained parameter (step order), when there are several:
# a ZeRO bucket holds one group (it runs one update chain)
UPDATE_GROUPS = "raf_dist.update_groups"
# the trained parameters (step order) whose gradients are this rank's alone (embedding tables
# sharded over the dp ranks): they carry no gradient marker, and ZeRO holds them whole
LOCAL_PARAMS = "raf_dist.local_params"
# a TIR block annotated with it is never inlined by the CPU schedule (compiler/schedule.py):
# a value computed once and read many times (passes/fast_math.py)
MATERIALIZE = "raf_dist.materialize"
# the CPU schedule's vectors (compiler/schedule.py), which TE kernels written for it shape
# their rows by: float32 lanes per vector, and the row length from which a row the lanes do
# not divide still gets vectors (the schedule predicates the last one; the fused loss pads
# its statistics to whole vectors, training/cross_entropy.py)
VECTOR_LANES = 8
LONG_ROW = 512
