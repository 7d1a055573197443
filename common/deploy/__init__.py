"""Deployment: the topology of shards and sites, the docker-compose file and its offline image, the
compose check, development certificates, and WAN link shaping (`tc`) and probing."""
