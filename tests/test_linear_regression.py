from recipes import linear_regression


def test_one_sgd_step_lowers_the_loss(capsys):
    before, after = linear_regression.main()
    assert before == 16.875  # the seed text's numbers: w=0.5 on y=2x
    assert after < before
    assert "loss decreased: True" in capsys.readouterr().out
