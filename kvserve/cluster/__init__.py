"""Scale-out (`kvserve cluster`): engine replicas on Ray Serve behind one ingress, prefix-affinity
routing, KV shared through the Redis tier. routing.py (the policy) and config.py need no Ray; the
rest imports it (pip install 'kvserve[cluster]'). docs/scale-out.md is the user's guide."""
