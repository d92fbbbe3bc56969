"""How many decode CTAs the GPU keeps resident, with and without clusters
(``device_facts.max_active_clusters``: the driver's occupancy calculator for a CTA of the
decode kernel's threads and shared memory).

A cluster merge only pays if every cluster of a step is resident at once: a launch of
B 8 x Hkv 8 groups x 4 splits needs 64 clusters of 4 (256 CTAs). For each kernel shape
(the default 64x2x2 tuning and the two-warpgroup 64x6x1) and cluster size this prints the
resident CTAs per SM without clusters and the resident clusters (x size = CTAs).

    python3 benchmarks/decode_clusters.py
"""


def main():
    import torch

    from flexattn.kernels.decode.sm90 import CLUSTER_SPLITS, DecodeConfig
    from flexattn.kernels.hopper.device_facts import max_active_clusters

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name()}, {sms} SMs")
    print("| tuning | cluster | CTAs/SM | resident clusters | resident CTAs |")
    print("|---|---|---|---|---|")
    shapes = {"64x2x2": dict(tile_n=64, num_stages=2, ctas_per_sm=2),
              "64x6x1 (2 wg)": dict(tile_n=64, num_stages=6, ctas_per_sm=1, num_mma_wg=2)}
    for name, kw in shapes.items():
        for cluster in CLUSTER_SPLITS:
            cfg = DecodeConfig(cluster_splits=cluster, **kw)
            footprint = dict(threads=128 * (1 + cfg.num_mma_wg), smem_bytes=cfg.smem_bytes)
            per_sm = max_active_clusters(0, 1, **footprint) // sms
            clusters = max_active_clusters(0, cluster, **footprint)
            print(f"| {name} | {cluster} | {per_sm} | {clusters} | {clusters * cluster} |", flush=True)


if __name__ == "__main__":
    main()
