"""The prefill Ray actor. Built in the cluster issue."""
