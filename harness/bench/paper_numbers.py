"""Published figures of Kusumoto et al. 2019, Tables 1 and 2, to print beside ours; never a
measurement.

Peak GB on a K40c (11.4 GB) with Chainer, parameters included; Table 1 with liveness analysis, Table 2
(appendix C) without. Keys: (strategy, mode); ``chen_sqrt`` stands for the paper's "Chen's" column (the
authors' ``Chen.cpp`` is the sqrt(n) rule). In Table 2,
``OUT_OF_MEMORY`` stands for the paper's "≥11.4": the run did not fit the K40c.
"""

K40C_GB = 11.4
OUT_OF_MEMORY = float("inf")

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

TABLE2_GB = {
    "pspnet": {("approx_dp", "mc"): 3.2, ("approx_dp", "tc"): 3.3, ("exact_dp", "mc"): 3.3, ("exact_dp", "tc"): 3.3,
               ("chen_sqrt", ""): 7.6, ("vanilla", ""): 9.4},
    "unet": {("approx_dp", "mc"): 6.8, ("approx_dp", "tc"): 6.8, ("exact_dp", "mc"): 6.8, ("exact_dp", "tc"): 6.8,
             ("chen_sqrt", ""): OUT_OF_MEMORY, ("vanilla", ""): 9.1},
    "resnet50": {("approx_dp", "mc"): 4.7, ("approx_dp", "tc"): 4.4, ("exact_dp", "mc"): 4.7,
                 ("exact_dp", "tc"): 4.4, ("chen_sqrt", ""): 6.7, ("vanilla", ""): 8.9},
    "resnet152": {("approx_dp", "mc"): 2.8, ("approx_dp", "tc"): 2.8, ("exact_dp", "mc"): 2.8,
                  ("exact_dp", "tc"): 2.8, ("chen_sqrt", ""): 4.1, ("vanilla", ""): 9.2},
    "vgg19": {("approx_dp", "mc"): 5.5, ("approx_dp", "tc"): 5.5, ("exact_dp", "mc"): 5.5, ("exact_dp", "tc"): 5.5,
              ("chen_sqrt", ""): 6.3, ("vanilla", ""): 7.0},
    "densenet161": {("approx_dp", "mc"): 1.9, ("approx_dp", "tc"): 2.0, ("exact_dp", "mc"): 1.9,
                    ("exact_dp", "tc"): 2.0, ("chen_sqrt", ""): 3.4, ("vanilla", ""): 8.5},
    "googlenet": {("approx_dp", "mc"): 6.0, ("approx_dp", "tc"): 6.0, ("exact_dp", "mc"): 6.0,
                  ("exact_dp", "tc"): 6.0, ("chen_sqrt", ""): OUT_OF_MEMORY, ("vanilla", ""): 8.5},
}
