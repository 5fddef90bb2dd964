"""Issue 35 item 5: a step without a trained target on plain text (no loss mask) is not blamed on loss
masking, which only fine-tuning data has."""

from lmpipe.consumer.runstats import untrained_reason


def test_plain_text_is_not_said_to_be_loss_masked():
    assert "loss-masked" not in untrained_reason(False)
    assert "single token" in untrained_reason(False)
    assert untrained_reason(True) == "every token loss-masked"
