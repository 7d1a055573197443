"""A site: one cluster as a torchrun job of pp × dp ranks, built from torch's own engines — FSDP2 inside
each stage (`parallelize`), `torch.distributed.pipelining` across stages (`trainer`), on a pp × dp
`DeviceMesh` (`mesh`) — with the DiLoCoX round around it: each rank exchanges the parameters it owns
(`reshard`, `access`)."""
