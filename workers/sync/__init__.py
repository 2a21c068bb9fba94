"""Weight sync: how the actor's weight versions reach rollout workers."""
