//! Settings owned by the component that reads them.
//!
//! Each component declares its settings once, with [`settings!`](crate::settings!): a struct
//! whose fields are the settings' keys, each with its documentation and default. The macro
//! derives the struct's serde (every field optional, defaulted) and keeps each field's
//! documentation for the binary, which builds its flags' help and its configuration
//! reference from it ([`Documented`]). The binary `#[serde(flatten)]`s the structs into its
//! configuration, so a key is the field's name wherever it is given.

/// One setting as the reference shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SettingDoc {
    /// Its key in the configuration file (and, upper-cased, its environment variable).
    pub key: &'static str,
    /// Its documentation comment, line by line as written (each line ends in `\n`).
    pub doc: &'static str,
}

/// Settings whose documentation can be read at run time.
pub trait Documented {
    /// Every field, in declaration order.
    const DOCS: &'static [SettingDoc];
}

/// Declares a settings struct: each field's documentation first, then its `#[serde(...)]`
/// attributes, then `pub name: Type = default,`.
///
/// ```
/// outbox_core::settings! {
///     /// How a part behaves.
///     #[derive(Clone, Debug, PartialEq)]
///     pub struct PartSettings {
///         /// Items taken at once.
///         pub batch: usize = 10,
///     }
/// }
/// use outbox_core::settings::Documented;
/// assert_eq!(PartSettings::default().batch, 10);
/// assert_eq!(PartSettings::DOCS[0].key, "batch");
/// ```
#[macro_export]
macro_rules! settings {
    (
        $(#[$attr:meta])*
        $vis:vis struct $name:ident {
            $(
                $(#[doc = $doc:literal])*
                $(#[serde($($serde:tt)*)])*
                pub $field:ident : $ty:ty = $default:expr,
            )*
        }
    ) => {
        // The derive first: serde's helper attributes among `$attr` come after it.
        #[derive(serde::Serialize, serde::Deserialize)]
        $(#[$attr])*
        #[serde(default)]
        $vis struct $name {
            $(
                $(#[doc = $doc])*
                $(#[serde($($serde)*)])*
                pub $field: $ty,
            )*
        }

        impl Default for $name {
            fn default() -> Self {
                $name { $($field: $default,)* }
            }
        }

        impl $crate::settings::Documented for $name {
            const DOCS: &'static [$crate::settings::SettingDoc] = &[
                $(
                    $crate::settings::SettingDoc {
                        key: stringify!($field),
                        doc: concat!($($doc, "\n",)*),
                    },
                )*
            ];
        }
    };
}
