"""Scale-out (issue 16): kvserve replicas behind one router. Built so far: the routing policy
(routing.py), which needs no Ray; the Ray Serve deployment is not built."""
