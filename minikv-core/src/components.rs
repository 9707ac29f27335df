//! Registry of every named component, for `minikv components` and for tests that
//! must deserialize every shipped `type` name.
//!
//! A component registers itself next to its definition with [`register!`](crate::register);
//! nothing else needs editing.

use serde::Serialize;
use std::fmt;

/// The extension points of minikv.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExtensionPoint {
    /// [`crate::TokenScorer`]: per-token importance scores.
    Scorer,
    /// [`crate::SelectionPolicy`]: per-layer (and per-head) token budgets.
    Policy,
    /// [`crate::Selector`]: picks the kept tokens from scores and budgets.
    Selector,
    /// [`crate::Quantizer`]: low-bit K/V storage.
    Quantizer,
    /// [`crate::Compensator`]: compensation for evicted tokens.
    Compensator,
    /// [`crate::ChannelPruner`]: which key channels are stored.
    Channels,
    /// [`crate::DecodeRegime`]: what happens to the stored rows while decoding.
    Decode,
    /// [`crate::PageScore`]: how pages of keys are summarized and scored for
    /// page selection at decode.
    PageScore,
    /// [`crate::residual::ResidualRule`]: when a quantized cache's residual
    /// rows are quantized.
    Residual,
}

impl ExtensionPoint {
    /// The config key under `[cache]` that holds this component.
    pub fn config_key(self) -> &'static str {
        match self {
            ExtensionPoint::Scorer => "cache.scorer",
            ExtensionPoint::Policy => "cache.policy",
            ExtensionPoint::Selector => "cache.selector",
            ExtensionPoint::Quantizer => "cache.quant.keys / cache.quant.values",
            ExtensionPoint::Compensator => "cache.compensator",
            ExtensionPoint::Channels => "cache.channels",
            ExtensionPoint::Decode => "cache.decode",
            ExtensionPoint::PageScore => "cache.pages.score",
            ExtensionPoint::Residual => "cache.quant.residual_mode",
        }
    }
}

impl fmt::Display for ExtensionPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            ExtensionPoint::Scorer => "scorer",
            ExtensionPoint::Policy => "policy",
            ExtensionPoint::Selector => "selector",
            ExtensionPoint::Quantizer => "quantizer",
            ExtensionPoint::Compensator => "compensator",
            ExtensionPoint::Channels => "channels",
            ExtensionPoint::Decode => "decode",
            ExtensionPoint::PageScore => "page_score",
            ExtensionPoint::Residual => "residual",
        };
        f.write_str(s)
    }
}

/// One registered component.
pub struct ComponentInfo {
    /// Which trait it implements.
    pub point: ExtensionPoint,
    /// Its `type` name in configs.
    pub name: &'static str,
    /// One line saying what it does.
    pub summary: &'static str,
    /// Its default value, serialized with the `type` tag (parameters and defaults).
    pub default: fn() -> serde_json::Value,
}

inventory::collect!(ComponentInfo);

/// All registered components, sorted by extension point then name.
pub fn all() -> Vec<&'static ComponentInfo> {
    let mut v: Vec<_> = inventory::iter::<ComponentInfo>.into_iter().collect();
    v.sort_by(|a, b| (a.point, a.name).cmp(&(b.point, b.name)));
    v
}

/// Registers a component for `minikv components` and the round-trip tests.
///
/// `register!(Scorer, "snapkv", SnapKv, "summary")` requires `SnapKv: Default` and
/// that its `#[typetag::serde(name = "snapkv")]` impl uses the same name. The
/// extension point is one of `Scorer`, `Policy`, `Selector`, `Quantizer`,
/// `Compensator`, `Channels`, `Decode`, `PageScore`, `Residual`.
#[macro_export]
macro_rules! register {
    (Scorer, $name:literal, $ty:ty, $summary:literal) => {
        $crate::register!(@inner Scorer, TokenScorer, $name, $ty, $summary);
    };
    (Policy, $name:literal, $ty:ty, $summary:literal) => {
        $crate::register!(@inner Policy, SelectionPolicy, $name, $ty, $summary);
    };
    (Selector, $name:literal, $ty:ty, $summary:literal) => {
        $crate::register!(@inner Selector, Selector, $name, $ty, $summary);
    };
    (Quantizer, $name:literal, $ty:ty, $summary:literal) => {
        $crate::register!(@inner Quantizer, Quantizer, $name, $ty, $summary);
    };
    (Compensator, $name:literal, $ty:ty, $summary:literal) => {
        $crate::register!(@inner Compensator, Compensator, $name, $ty, $summary);
    };
    (Channels, $name:literal, $ty:ty, $summary:literal) => {
        $crate::register!(@inner Channels, ChannelPruner, $name, $ty, $summary);
    };
    (Decode, $name:literal, $ty:ty, $summary:literal) => {
        $crate::register!(@inner Decode, DecodeRegime, $name, $ty, $summary);
    };
    (PageScore, $name:literal, $ty:ty, $summary:literal) => {
        $crate::register!(@inner PageScore, PageScore, $name, $ty, $summary);
    };
    (Residual, $name:literal, $ty:ty, $summary:literal) => {
        $crate::register!(@inner Residual, ResidualRule, $name, $ty, $summary);
    };
    (@inner $point:ident, $tr:ident, $name:literal, $ty:ty, $summary:literal) => {
        $crate::__inventory::submit! {
            $crate::components::ComponentInfo {
                point: $crate::components::ExtensionPoint::$point,
                name: $name,
                summary: $summary,
                default: || {
                    let b: ::std::boxed::Box<dyn $crate::$tr> =
                        ::std::boxed::Box::new(<$ty as ::std::default::Default>::default());
                    $crate::__serde_json::to_value(&b).expect("component defaults serialize")
                },
            }
        }
    };
}

/// Builds a component from its `type` name alone (all parameters default).
pub fn from_type_name<T: ?Sized>(field: &str, name: &str) -> crate::Result<Box<T>>
where
    Box<T>: serde::de::DeserializeOwned,
{
    serde_json::from_value(serde_json::json!({ "type": name })).map_err(|e| {
        crate::Error::config(
            field,
            format!("cannot build default `{name}`: {e} (is minikv-policies linked?)"),
        )
    })
}
