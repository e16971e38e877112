//! End-to-end training on the CPU backend: a smaller configuration of
//! `examples/train_ctr.rs` (the same code, included as a module) must learn its planted CTR
//! model: the training loss falls by at least 10% and the held-out AUC exceeds 0.7. And the
//! pieces it relies on: `stack_feature_gradients` is the exact adjoint of
//! `feature_activations`, with typed errors; the AUC is the Mann-Whitney statistic.

#[allow(dead_code)]
#[path = "../../examples/train_ctr.rs"]
mod example;

use example::{auc, check, dataset, train, Settings};

#[test]
fn small_training_run_learns_the_planted_model() {
    let settings = Settings {
        batch_size: 512,
        train_batches: 24,
        heldout_batches: 8,
        epochs: 4,
        ..Settings::default()
    };
    let data = dataset(&settings).unwrap();
    assert_eq!((data.train.len(), data.heldout.len()), (24, 8));
    assert!(
        data.positive_rate > 0.3 && data.positive_rate < 0.7,
        "{}",
        data.positive_rate
    );
    // The labels follow the planted model: its own logits rank them well.
    assert!(
        data.planted_heldout_auc > 0.8,
        "{}",
        data.planted_heldout_auc
    );
    let reports = train(&settings, &data, |_| {}).unwrap();
    assert_eq!(reports.len(), 4);
    for r in &reports {
        assert!(
            r.train_loss.is_finite() && r.heldout_loss.is_finite(),
            "{r:?}"
        );
    }
    // A model that learned nothing stays at the loss of a constant, about ln 2.
    assert!(
        (reports[0].train_loss - 2f64.ln()).abs() < 0.2,
        "{:?}",
        reports[0]
    );
    let (first, last) = (reports[0], reports[3]);
    assert!(last.train_loss <= 0.9 * first.train_loss, "{reports:?}");
    assert!(last.heldout_auc > 0.7, "{reports:?}");
    assert!(
        last.heldout_auc <= data.planted_heldout_auc + 0.02,
        "{reports:?} vs {}",
        data.planted_heldout_auc
    );
    check(&reports).unwrap();
    // Deterministic: the same settings give the same numbers.
    let again = train(&settings, &data, |_| {}).unwrap();
    assert_eq!(again, reports);
}

#[test]
fn auc_is_the_mann_whitney_statistic() {
    assert_eq!(auc(&[0.1, 0.2, 0.3, 0.4], &[0.0, 0.0, 1.0, 1.0]), 1.0);
    assert_eq!(auc(&[0.4, 0.3, 0.2, 0.1], &[0.0, 0.0, 1.0, 1.0]), 0.0);
    // Ties count half: one positive tied with one negative, one above both.
    assert_eq!(auc(&[0.5, 0.5, 0.9], &[1.0, 0.0, 1.0]), 0.75);
    // Pairs (pos, neg): (0.3 > 0.2), (0.3 < 0.35), (0.8 > 0.2), (0.8 > 0.35) -> 3/4.
    assert_eq!(auc(&[0.3, 0.2, 0.8, 0.35], &[1.0, 0.0, 1.0, 0.0]), 0.75);
    assert_eq!(auc(&[0.3, 0.2], &[1.0, 1.0]), 0.5);
}

#[test]
fn the_check_fails_a_trainer_that_does_not_learn() {
    // Learning rates of 0: nothing moves, the loss stays where it started.
    let settings = Settings {
        batch_size: 256,
        train_batches: 6,
        heldout_batches: 2,
        epochs: 2,
        embedding_lr: 0.0,
        head_lr: 0.0,
        ..Settings::default()
    };
    let data = dataset(&settings).unwrap();
    let reports = train(&settings, &data, |_| {}).unwrap();
    assert_eq!(reports[0].train_loss, reports[1].train_loss);
    assert_eq!(reports[0].heldout_auc, reports[1].heldout_auc);
    let e = check(&reports).unwrap_err();
    assert!(e.contains("fell by 0.0%"), "{e}");
    assert!(check(&[]).is_err());
}
