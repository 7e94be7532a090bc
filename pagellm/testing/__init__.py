"""Test helpers shipped with pagellm, so plugin authors can check their implementations as we check ours."""
