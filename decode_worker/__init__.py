"""The decode Ray actor. Built in the cluster issue."""
