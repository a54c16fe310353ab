"""Published figures of seed 004 (Kusumoto et al. 2019), Table 1, to print beside ours; never a measurement.

Peak GB on a K40c with Chainer, parameters included, with liveness analysis (``../shared/spec/kusumoto.md``
section 9). Keys: (strategy, mode); ``chen_sqrt`` stands for the paper's "Chen's" column.
"""

TABLE1_GB = {
    "pspnet": {("approx_dp", "mc"): 2.7, ("approx_dp", "tc"): 3.1, ("exact_dp", "mc"): 2.8, ("exact_dp", "tc"): 3.2,
               ("chen_sqrt", ""): 4.0, ("vanilla", ""): 9.4},
    "unet": {("approx_dp", "mc"): 5.0, ("approx_dp", "tc"): 6.7, ("exact_dp", "mc"): 4.7, ("exact_dp", "tc"): 5.3,
             ("chen_sqrt", ""): 7.4, ("vanilla", ""): 9.1},
    "resnet50": {("approx_dp", "mc"): 3.4, ("approx_dp", "tc"): 4.4, ("exact_dp", "mc"): 3.4,
                 ("exact_dp", "tc"): 4.3, ("chen_sqrt", ""): 3.7, ("vanilla", ""): 8.9},
    "resnet152": {("approx_dp", "mc"): 2.3, ("approx_dp", "tc"): 2.5, ("exact_dp", "mc"): 2.3,
                  ("exact_dp", "tc"): 2.5, ("chen_sqrt", ""): 2.4, ("vanilla", ""): 9.2},
    "vgg19": {("approx_dp", "mc"): 4.5, ("approx_dp", "tc"): 5.5, ("exact_dp", "mc"): 4.5, ("exact_dp", "tc"): 5.5,
              ("chen_sqrt", ""): 4.7, ("vanilla", ""): 7.0},
    "densenet161": {("approx_dp", "mc"): 1.6, ("approx_dp", "tc"): 1.9, ("exact_dp", "mc"): 1.7,
                    ("exact_dp", "tc"): 1.8, ("chen_sqrt", ""): 1.8, ("vanilla", ""): 8.5},
    "googlenet": {("approx_dp", "mc"): 5.2, ("approx_dp", "tc"): 5.5, ("exact_dp", "mc"): 5.2,
                  ("exact_dp", "tc"): 5.9, ("chen_sqrt", ""): 6.5, ("vanilla", ""): 8.5},
}
